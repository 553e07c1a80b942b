"""Real transfers between this process and peer processes, compared byte for byte."""
from __future__ import annotations

import random

import pytest
import torch

from tests.transfer.conftest import LAYOUT, PROCESS_BACKENDS
from tests.transfer.peer_proc import block_bytes, fill


def random_blocks(rng: random.Random, count: int) -> tuple[list[int], list[int]]:
    """Non-contiguous source and destination ids with some adjacent runs mixed in."""
    src = rng.sample(range(LAYOUT.num_blocks), count)
    start = rng.randrange(LAYOUT.num_blocks - count)
    dst = list(range(start, start + count // 2)) + rng.sample(
        [b for b in range(LAYOUT.num_blocks) if not start <= b < start + count // 2], count - count // 2)
    return src, dst


def expected(seed: int, ids: list[int]) -> bytes:
    pool = torch.empty(LAYOUT.shape, dtype=LAYOUT.torch_dtype)
    fill(pool, seed)
    return block_bytes(pool, ids)


@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_push_and_pull_random_blocks(backend: str, make_engine, make_peer) -> None:
    engine = make_engine(backend, seed=7)
    peer = make_peer(backend, seed=8)
    peer_id = engine.connect(peer.call("descriptor"))
    rng = random.Random(backend)
    theirs, ours = random_blocks(rng, 17)
    engine.queue_transfer_with_token(peer_id, theirs, ours, direction="pull").wait(20)
    assert block_bytes(engine._region.tensor, ours) == expected(8, theirs)

    src, dst = random_blocks(rng, 24)
    src = [b for b in src if b not in ours][:12]
    engine.queue_transfer_with_token(peer_id, src, dst[:len(src)]).wait(20)
    assert peer.call("dump", dst[:len(src)]) == expected(7, src)


@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_peer_process_pushes_into_our_pool(backend: str, make_engine, make_peer) -> None:
    engine = make_engine(backend, seed=3)
    peer = make_peer(backend, seed=4)
    ours_id = peer.call("connect", engine.descriptor())
    src, dst = random_blocks(random.Random(5), 30)
    assert peer.call("transfer", ours_id, src, dst, 20.0, "push") is None
    assert block_bytes(engine._region.tensor, dst) == expected(4, src)


@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_sixteen_concurrent_transfers_to_two_peers(backend: str, make_engine, make_peer) -> None:
    engine = make_engine(backend, seed=11)
    peers = [make_peer(backend, seed=s) for s in (12, 13)]
    ids = [engine.connect(p.call("descriptor")) for p in peers]
    rng = random.Random(16)
    # Each peer gets 8 transfers into disjoint destination blocks, all queued at once.
    jobs = []
    for n, peer_id in enumerate(ids):
        dst_all = rng.sample(range(LAYOUT.num_blocks), 8 * 10)
        for k in range(8):
            src = rng.sample(range(LAYOUT.num_blocks), 10)
            dst = dst_all[k * 10:(k + 1) * 10]
            jobs.append((n, src, dst, engine.queue_transfer_with_token(peer_id, src, dst)))
    for _, _, _, token in jobs:
        token.wait(30)
    for n, src, dst, _ in jobs:
        assert peers[n].call("dump", dst) == expected(11, src)
