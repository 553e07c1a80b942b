"""The optional integrity check of pulled KV blocks: the prefill sends a CRC-32 of what it
pushed, the decode compares it with its own over the blocks that landed."""
from __future__ import annotations

from typing import ContextManager, Iterator

import pytest
import torch

from neuron_connector import IntegrityError, ProtocolError, PullState, UnknownRequest
from neuron_connector.lookup import LookupTable, Start
from neuron_connector.protocol import CRC32C, LookupReply
from neuron_connector.pulls import PullTracker
from tests.helpers import wait_until
from tests.neuron_connector.conftest import Pair, running_pair
from tests.neuron_connector.kv import corrupting_engine, wait_terminal

PEER = "127.0.0.1:14579"


def _tracker_with_lookup_sent(checksum: str | None) -> PullTracker:
    tracker = PullTracker(checksum=checksum)
    tracker.add("r", PEER, [4, 5], deadline=10.0, now=0.0)
    [(_, lookup)] = tracker.due(0.0, {PEER})
    assert lookup.checksum == checksum
    return tracker


def test_a_matching_checksum_turns_the_pull_done() -> None:
    tracker = _tracker_with_lookup_sent(CRC32C)
    tracker.on_reply(LookupReply("r", True, 7, (4, 5), checksum=0xABCD), 0.1, local_checksum=0xABCD)
    status = tracker.poll("r")
    assert status.state is PullState.DONE and status.output_token == 7


def test_a_different_checksum_fails_the_pull_naming_peer_and_request() -> None:
    tracker = _tracker_with_lookup_sent(CRC32C)
    tracker.on_reply(LookupReply("r", True, 7, (4, 5), checksum=0xABCD), 0.1, local_checksum=0xABCE)
    assert tracker.take_finished() == ["r"]     # announced, as every failure
    status = tracker.poll("r")
    assert status.state is PullState.FAILED and isinstance(status.error, IntegrityError)
    assert status.message == (f"KV blocks of 'r' from prefill peer {PEER} are corrupt: crc32c 0x0000abce of our "
                               "blocks [4, 5], the peer sent 0x0000abcd")


def test_a_peer_that_sends_no_checksum_fails_the_checked_pull() -> None:
    tracker = _tracker_with_lookup_sent(CRC32C)
    tracker.on_reply(LookupReply("r", True, 7, (4, 5)), 0.1, local_checksum=None)
    status = tracker.poll("r")
    assert isinstance(status.error, ProtocolError) and "sent no crc32c checksum of 'r'" in status.message


def test_unchecked_pulls_ignore_a_checksum() -> None:
    tracker = _tracker_with_lookup_sent(None)
    tracker.on_reply(LookupReply("r", True, 7, (4, 5), checksum=1), 0.1)
    assert tracker.poll("r").state is PullState.DONE


def test_the_prefill_answers_a_repeated_lookup_with_the_same_checksum() -> None:
    table = LookupTable(abort_timeout=60.0)
    table.publish("r", [1, 2], output_token=9, now=0.0)
    assert table.lookup("r", b"d0", (5, 6)) == Start((1, 2), (5, 6))
    peer, reply = table.transfer_done("r", None, 0.1, checksum=0x1234)
    assert peer == b"d0" and reply == LookupReply("r", True, 9, (5, 6), checksum=0x1234)
    assert table.lookup("r", b"d0", (5, 6)).reply == reply  # a lost reply is answered again, alike
    assert table.take_releases() == ["r"]


@pytest.fixture(params=["shm", "tcp"])
def checked_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    with running_pair(request.param, integrity_check=True) as pair:
        yield pair


def test_a_checked_pull_moves_every_byte_and_turns_done(checked_pair: Pair) -> None:
    src, dst = [3, 7, 8, 1], [0, 5, 6, 9]
    checked_pair.send.publish("r1", src, output_token=1234)
    checked_pair.recv.request_pull("r1", "127.0.0.1", checked_pair.send.port, dst)
    status = wait_terminal(checked_pair.recv, "r1")
    assert status.state is PullState.DONE and status.output_token == 1234, status
    assert torch.equal(checked_pair.d_pool[:, :, dst], checked_pair.p_pool[:, :, src])
    wait_until(lambda: checked_pair.releases() == ["r1"], timeout=5, what="on_release")


def _corrupting_pair(integrity_check: bool) -> ContextManager[Pair]:
    return running_pair("shm", integrity_check=integrity_check, p_engine=corrupting_engine(corruptions=1))


def _differing_bytes(pair: Pair, src: list[int], dst: list[int]) -> int:
    sent, landed = (t.contiguous().view(torch.uint8) for t in (pair.p_pool[:, :, src], pair.d_pool[:, :, dst]))
    return int((sent != landed).sum())


def test_a_corrupted_push_fails_the_pull_and_its_blocks_are_free_again() -> None:
    with _corrupting_pair(integrity_check=True) as pair:
        src, dst = [2, 3], [10, 11]
        pair.send.publish("bad", src, output_token=5)
        pair.recv.request_pull("bad", "127.0.0.1", pair.send.port, dst)
        status = wait_terminal(pair.recv, "bad")
        assert status.state is PullState.FAILED and isinstance(status.error, IntegrityError), status
        assert f"KV blocks of 'bad' from prefill peer 127.0.0.1:{pair.send.port} are corrupt" in status.message
        assert _differing_bytes(pair, src, dst) == 1
        # Released on both sides: the prefill freed its blocks, the pull is over and forgotten ...
        wait_until(lambda: pair.releases() == ["bad"], timeout=5, what="the prefill's release")
        assert pair.send.pending() == 0
        with pytest.raises(UnknownRequest):
            pair.recv.poll("bad")
        # ... and the same destination blocks take the next pull, whose push arrives intact.
        pair.send.publish("good", src, output_token=6)
        pair.recv.request_pull("good", "127.0.0.1", pair.send.port, dst)
        assert wait_terminal(pair.recv, "good").state is PullState.DONE
        assert _differing_bytes(pair, src, dst) == 0


def test_without_the_check_the_same_corruption_goes_unnoticed() -> None:
    with _corrupting_pair(integrity_check=False) as pair:
        pair.send.publish("bad", [2], output_token=5)
        pair.recv.request_pull("bad", "127.0.0.1", pair.send.port, [10])
        assert wait_terminal(pair.recv, "bad").state is PullState.DONE
        assert _differing_bytes(pair, [2], [10]) == 1
