"""Real transfers between this process and peer processes, compared byte for byte."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

import pytest

from tests.transfer.conftest import LAYOUT, OUR_PIDS, PROCESS_BACKENDS
from tests.transfer.peer_proc import PeerProcess, block_bytes, fill
from transfer import TransferEngine, create_transfer_engine


@dataclass
class Setup:
    engine: TransferEngine
    peers: list[PeerProcess]
    peer_ids: list[str]

    def ours(self, ids: list[int]) -> bytes:
        return block_bytes(self.engine._region.tensor, ids)  # type: ignore[union-attr]


@pytest.fixture(scope="module", params=PROCESS_BACKENDS)
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    """Our engine and two peer processes on one backend, shared by this module's tests."""
    backend = request.param
    engine = create_transfer_engine(backend)
    fill(engine.allocate_region(LAYOUT), seed=7)
    peers: list[PeerProcess] = []
    try:
        for seed in (8, 9):
            peers.append(PeerProcess.start(backend, LAYOUT.to_dict(), seed))
            OUR_PIDS.add(peers[-1].pid)
        yield Setup(engine, peers, [engine.connect(p.call("descriptor")) for p in peers])
    finally:
        for peer in peers:
            peer.stop()
        engine.close()


def random_blocks(rng: random.Random, count: int) -> tuple[list[int], list[int]]:
    """Non-contiguous source and destination ids, with an adjacent run mixed in."""
    src = rng.sample(range(LAYOUT.num_blocks), count)
    start = rng.randrange(LAYOUT.num_blocks - count)
    run = list(range(start, start + count // 2))
    rest = [b for b in range(LAYOUT.num_blocks) if b not in run]
    return src, run + rng.sample(rest, count - len(run))


def test_push_random_blocks(setup: Setup) -> None:
    src, dst = random_blocks(random.Random(1), 24)
    setup.engine.queue_transfer_with_token(setup.peer_ids[0], src, dst).wait(20)
    assert setup.peers[0].call("dump", dst) == setup.ours(src)


def test_peer_process_pushes_into_our_pool(setup: Setup) -> None:
    peer = setup.peers[0]
    our_id = peer.call("connect", setup.engine.descriptor())
    src, dst = random_blocks(random.Random(3), 30)
    sent = peer.call("dump", src)
    assert peer.call("transfer", our_id, src, dst, 20.0) is None
    assert setup.ours(dst) == sent


def test_sixteen_concurrent_transfers_to_two_peers(setup: Setup) -> None:
    rng = random.Random(16)
    jobs = []
    for n, peer_id in enumerate(setup.peer_ids):
        # 8 transfers per peer, all queued at once, into disjoint destination blocks.
        dst_all = rng.sample(range(LAYOUT.num_blocks), 8 * 10)
        for k in range(8):
            src, dst = rng.sample(range(LAYOUT.num_blocks), 10), dst_all[k * 10:(k + 1) * 10]
            jobs.append((n, src, dst, setup.engine.queue_transfer_with_token(peer_id, src, dst)))
    for *_, token in jobs:
        token.wait(30)
    for n, src, dst, _ in jobs:
        assert setup.peers[n].call("dump", dst) == setup.ours(src)
