"""Each failure ends its token with a typed error in time, and the engine keeps working."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from stack.serving import Process

from tests.helpers import wait_until
from tests.transfer.conftest import LAYOUT, OUR_PIDS, PROCESS_BACKENDS, shm_segments
from tests.transfer.peer_proc import block_bytes, exit_without_close
from transfer import (KVLayout, PeerLost, RegionNotRegistered, TransferEngine, TransferTimeout)
from transfer.region import unlink_segment

# Large enough that a whole-pool transfer cannot fit in loopback socket buffers.
BIG = KVLayout(num_layers=4, num_blocks=256, block_size=16, num_kv_heads=8, head_dim=64, dtype="float32")
ALL = list(range(BIG.num_blocks))


def still_works(engine: TransferEngine, make_engine, backend: str) -> None:
    """A fresh peer gets exact bytes from `engine` after a failure."""
    layout = engine._region.layout
    other = make_engine(backend, layout=layout)
    peer = engine.connect(other.descriptor())
    engine.queue_transfer_with_token(peer, [1, 2, 5], [7, 3, 4]).wait(20)
    assert block_bytes(other._region.tensor, [7, 3, 4]) == block_bytes(engine._region.tensor, [1, 2, 5])


def test_tcp_peer_killed_mid_transfer(make_engine, make_peer) -> None:
    engine = make_engine("tcp", layout=BIG, seed=1)
    victim = make_peer("tcp", layout=BIG)
    peer = engine.connect(victim.call("descriptor"))
    victim.pause()  # the peer stops reading: the sender blocks with bytes in flight
    token = engine.queue_transfer_with_token(peer, ALL, ALL, timeout=60)
    wait_until(lambda: token._state == "running", timeout=10, what="transfer in flight")
    assert not token.is_done()
    victim.kill()
    with pytest.raises(PeerLost):
        token.wait(10)
    with pytest.raises(PeerLost):
        engine.queue_transfer_with_token(peer, [0], [0]).wait(10)
    still_works(engine, make_engine, "tcp")


@pytest.mark.parametrize("backend", [b for b in PROCESS_BACKENDS if b != "tcp"])
def test_one_sided_peer_killed_during_transfers(backend: str, make_engine, make_peer) -> None:
    """shm and nixl copies need no help from the peer, so its death is seen between copies."""
    engine = make_engine(backend, layout=BIG, seed=1)
    victim = make_peer(backend, layout=BIG)
    peer = engine.connect(victim.call("descriptor"))
    tokens = [engine.queue_transfer_with_token(peer, ALL, ALL) for _ in range(6)]
    tokens[0].wait(20)
    victim.kill()
    after = engine.queue_transfer_with_token(peer, ALL, ALL)
    for token in tokens[1:]:
        wait_until(token.is_done, timeout=20, what="queued transfer to end")
        assert token.error is None or isinstance(token.error, (PeerLost, TransferTimeout))
    with pytest.raises(PeerLost):
        after.wait(20)
    # The dead owner's segment is unlinked by the side that noticed the death.
    assert not any(f"-{victim.pid}-" in name for name in shm_segments())
    still_works(engine, make_engine, backend)


def test_tcp_peer_never_answers(make_engine, make_peer) -> None:
    engine = make_engine("tcp", layout=BIG, seed=2)
    slow = make_peer("tcp", layout=BIG)
    peer = engine.connect(slow.call("descriptor"))
    slow.pause()
    started = time.monotonic()
    stuck = engine.queue_transfer_with_token(peer, ALL, ALL, timeout=1.5)
    queued = engine.queue_transfer_with_token(peer, [0], [0], timeout=0.5)
    with pytest.raises(TransferTimeout):
        queued.wait(5)  # expires in the queue behind the stuck one
    with pytest.raises(TransferTimeout):
        stuck.wait(5)
    assert time.monotonic() - started < 5
    slow.resume()
    # Same peer, new connection: exact bytes again.
    engine.queue_transfer_with_token(peer, [3, 4, 9], [10, 11, 0]).wait(20)
    assert slow.call("dump", [10, 11, 0]) == block_bytes(engine._region.tensor, [3, 4, 9])


@pytest.mark.parametrize("backend", [b for b in PROCESS_BACKENDS if b != "tcp"])
def test_one_sided_transfer_needs_no_answer_from_a_stopped_peer(backend: str, make_engine, make_peer) -> None:
    engine = make_engine(backend, seed=3)
    stopped = make_peer(backend)
    peer = engine.connect(stopped.call("descriptor"))
    engine.queue_transfer_with_token(peer, [0], [0], timeout=10).wait(15)  # link established
    stopped.pause()
    engine.queue_transfer_with_token(peer, [5, 6], [1, 2], timeout=5).wait(10)
    stopped.resume()
    assert stopped.call("dump", [1, 2]) == block_bytes(engine._region.tensor, [5, 6])


@pytest.mark.skipif("nixl" not in PROCESS_BACKENDS, reason="nixl is not installed")
def test_nixl_peer_never_answers_the_connection(make_engine, make_peer) -> None:
    """UCX needs the peer to take part in wiring up a new connection."""
    engine = make_engine("nixl", seed=5)
    slow = make_peer("nixl")
    peer = engine.connect(slow.call("descriptor"))
    slow.pause()
    with pytest.raises(TransferTimeout):
        engine.queue_transfer_with_token(peer, [1], [1], timeout=1.5).wait(10)
    slow.resume()
    engine.queue_transfer_with_token(peer, [3, 4], [8, 9], timeout=20).wait(25)
    assert slow.call("dump", [8, 9]) == block_bytes(engine._region.tensor, [3, 4])


def test_owner_exiting_without_close_leaves_no_segment() -> None:
    proc = exit_without_close(LAYOUT.to_dict())
    OUR_PIDS.add(proc.pid)
    assert proc.exitcode == 0
    assert not any(f"-{proc.pid}-" in name for name in shm_segments())


def test_tcp_unreachable_peer(make_engine) -> None:
    engine = make_engine("tcp")
    gone = make_engine("tcp")
    descriptor = gone.descriptor()
    gone.close()  # nothing listens on its port any more
    peer = engine.connect(descriptor)
    with pytest.raises(PeerLost):
        engine.queue_transfer_with_token(peer, [0], [0], timeout=5).wait(10)
    still_works(engine, make_engine, "tcp")


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_peer_unregistered_its_region(backend: str, make_engine, make_peer) -> None:
    engine = make_engine(backend, seed=4)
    peer_proc = make_peer(backend)
    peer = engine.connect(peer_proc.call("descriptor"))
    engine.queue_transfer_with_token(peer, [1], [1]).wait(10)
    peer_proc.call("unregister")
    with pytest.raises(RegionNotRegistered):
        engine.queue_transfer_with_token(peer, [1], [2]).wait(10)
    still_works(engine, make_engine, backend)


@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_local_region_unregistered(backend: str, make_engine) -> None:
    engine, other = make_engine(backend), make_engine(backend)
    peer = engine.connect(other.descriptor())
    engine.unregister_region()
    with pytest.raises(RegionNotRegistered):
        engine.queue_transfer_with_token(peer, [1], [2]).wait(10)
    engine.allocate_region(LAYOUT)  # registering again makes the engine usable again
    engine.queue_transfer_with_token(peer, [1], [2]).wait(10)


def test_pool_of_a_killed_owner_is_reaped_by_the_next_allocation(make_engine, make_peer) -> None:
    """kill -9 leaves no chance to unlink: the next shm pool allocated on the host removes it."""
    victim = make_peer("shm")
    victim.call("descriptor")
    assert any(f"-{victim.pid}-" in name for name in shm_segments())
    victim.kill()
    assert any(f"-{victim.pid}-" in name for name in shm_segments())   # nobody mapped it: still there
    make_engine("shm")
    assert not any(f"-{victim.pid}-" in name for name in shm_segments())


def test_connecting_to_a_dead_unreaped_owner_is_peer_lost(make_engine) -> None:
    """A killed owner that its parent has not reaped yet still has a pid, and its segment is
    gone (another link or the reaper removed it): that is a lost peer, not an unregistered pool."""
    owner = Process("shm-owner", ["-c", _OWNER])
    try:
        line = wait_until(lambda: owner.output().partition("\n")[0] if "\n" in owner.output() else None,
                          timeout=60, what="owner's descriptor")
        descriptor = json.loads(line)
        os.kill(owner.pid, signal.SIGKILL)  # no wait(): the owner stays a zombie
        wait_until(lambda: Path(f"/proc/{owner.pid}/stat").read_text().split(") ")[1][0] == "Z",
                   timeout=10, what="killed owner to be a zombie")
        unlink_segment(descriptor["transports"]["shm"]["segment"])
        engine = make_engine("shm")
        peer = engine.connect(descriptor)
        with pytest.raises(PeerLost, match="died"):
            engine.queue_transfer_with_token(peer, [0], [0]).wait(10)
    finally:
        owner.stop()


_OWNER = f"""
import json, time
from transfer import KVLayout, create_transfer_engine
engine = create_transfer_engine("shm")
engine.allocate_region(KVLayout.from_dict({LAYOUT.to_dict()!r}))
print(json.dumps(engine.descriptor()), flush=True)
time.sleep(600)
"""
