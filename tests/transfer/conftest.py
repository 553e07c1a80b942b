from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.transfer.peer_proc import PeerProcess
from transfer import KVLayout, TransferEngine, available_backends, create_transfer_engine

# Small enough for a fast suite, big enough for many chunk ranges per run.
LAYOUT = KVLayout(num_layers=3, num_blocks=96, block_size=16, num_kv_heads=2, head_dim=32, dtype="bfloat16")
PROCESS_BACKENDS = ["shm", "tcp"] + (["nixl"] if "nixl" in available_backends() else [])


# Other suites on this host may create segments at the same time: only ours count.
OUR_PIDS: set[int] = {os.getpid()}


def shm_segments() -> set[str]:
    """Our live segments; names are neuron-di-kv-<engine hex>-<pid>-<suffix>."""
    return {p.name for p in Path("/dev/shm").iterdir()
            if p.name.startswith("neuron-di-kv-") and int(p.name.split("-")[4]) in OUR_PIDS}


@pytest.fixture
def make_engine() -> Iterator[Callable[..., TransferEngine]]:
    engines: list[TransferEngine] = []

    def make(backend: str = "shm", layout: KVLayout = LAYOUT, seed: int | None = None,
             secret: bytes | None = None) -> TransferEngine:
        from tests.transfer.peer_proc import fill
        engine = create_transfer_engine(backend, secret=secret)
        engines.append(engine)
        pool = engine.allocate_region(layout)
        if seed is not None:
            fill(pool, seed)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def make_peer() -> Iterator[Callable[..., PeerProcess]]:
    peers: list[PeerProcess] = []

    def make(backend: str, layout: KVLayout = LAYOUT, seed: int = 1) -> PeerProcess:
        peer = PeerProcess.start(backend, layout.to_dict(), seed)
        OUR_PIDS.add(peer.pid)
        peers.append(peer)
        return peer

    yield make
    for peer in peers:
        peer.stop()


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = shm_segments()
    yield
    leaked = shm_segments() - before
    for name in leaked:
        os.unlink(Path("/dev/shm") / name)
    assert not leaked, f"leaked shm segments: {leaked}"
