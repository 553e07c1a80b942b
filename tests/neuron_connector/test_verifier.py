"""The decode side's check thread: it answers each checked reply with our checksum of the blocks
the reply names, whether it followed the push as it landed or sums them whole."""
from __future__ import annotations

import queue
from typing import Iterator

import pytest

from neuron_connector.protocol import LookupReply
from neuron_connector.verifier import PullVerifier
from tests.neuron_connector.kv import LAYOUT, engine_with_pool

SRC, DST = [1, 2, 9], [5, 6, 12]


@pytest.fixture
def engines() -> Iterator[tuple]:
    (src, _), (dst, _) = engine_with_pool("shm", seed=1), engine_with_pool("shm", seed=2)
    answers: queue.Queue = queue.Queue()
    verifier = PullVerifier(dst, "kv-verify-test", lambda address, reply, local: answers.put((reply, local)),
                            LAYOUT.block_bytes, follow_min_bytes=0)   # these few blocks followed as a large pull
    verifier.start()
    yield src, dst, verifier, answers
    verifier.close()
    src.close()
    dst.close()


def _push(src, dst, generation: int) -> int:
    token = src.queue_transfer_with_token(src.connect(dst.descriptor()), SRC, DST, checksum=True,
                                          generation=generation)
    token.wait(10)
    return token.checksum


def test_a_followed_pull_is_answered_with_the_checksum_of_its_blocks(engines) -> None:
    src, dst, verifier, answers = engines
    dst.fences.open(DST, 3)
    verifier.watch("r", DST)
    sent = _push(src, dst, 3)
    verifier.verify("peer", LookupReply("r", True, block_ids_in_peer_device=tuple(DST), checksum=sent))
    reply, local = answers.get(timeout=10)
    assert reply.request_id == "r" and local == sent == dst.checksum(DST)


def test_a_reply_naming_other_blocks_or_a_forgotten_pull_is_summed_whole(engines) -> None:
    src, dst, verifier, answers = engines
    dst.fences.open(DST, 4)
    verifier.watch("r", DST)
    verifier.watch("gone", [0])
    verifier.forget(["gone"])
    _push(src, dst, 4)
    verifier.verify("peer", LookupReply("r", True, block_ids_in_peer_device=(5, 6), checksum=1))
    verifier.verify("peer", LookupReply("gone", True, block_ids_in_peer_device=(0,), checksum=1))
    verifier.verify("peer", LookupReply("bad", True, block_ids_in_peer_device=(99,), checksum=1))
    assert answers.get(timeout=10)[1] == dst.checksum([5, 6])
    assert answers.get(timeout=10)[1] == dst.checksum([0])
    assert answers.get(timeout=10)[1] is None     # not our blocks: the pull fails on them
