"""Prefill in a child process, decode in the test process: handshake, pulls, restarts."""
from __future__ import annotations

import os
import re
import signal
import time
from typing import Iterator

import pytest
import torch

from neuron_connector import LayoutMismatch, PullState, RecvBuffer
from neuron_connector.errors import EngineMismatch, PeerUnavailable
from stack.serving import Process, free_port
from tests.helpers import wait_until
from tests.neuron_connector.kv import LAYOUT, engine_with_pool, seeded, wait_terminal


def kill9_and_reap(proc: Process) -> None:
    """SIGKILL leaves the process's shm pool behind (nobody unlinks it); the test does."""
    pid = proc.pid
    proc.kill()
    for name in os.listdir("/dev/shm"):
        if f"-{pid}-" in name:
            os.unlink(os.path.join("/dev/shm", name))


def start_prefill(port: int, *extra: str, backend: str = "shm") -> Process:
    proc = Process("prefill", ["-m", "tests.neuron_connector.prefill_proc", "--port", str(port),
                               "--backend", backend, *extra], env={"OMP_NUM_THREADS": "1"})
    def ready() -> bool:
        if proc.proc.poll() is not None:
            raise AssertionError(f"prefill exited:\n{proc.output()[-3000:]}")
        return bool(re.search(r"READY \d+", proc.output()))
    wait_until(ready, timeout=60, what="the prefill process")
    return proc


def _decode(backend: str) -> Iterator[tuple[RecvBuffer, torch.Tensor, str]]:
    engine, pool = engine_with_pool(backend)
    recv = RecvBuffer(engine, LAYOUT, engine_id="127.0.0.1:8200", default_timeout=20.0)
    recv.start()
    try:
        yield recv, pool, backend
    finally:
        recv.close()
        engine.close()


@pytest.fixture(params=["shm", "tcp"])
def decode(request: pytest.FixtureRequest) -> Iterator[tuple[RecvBuffer, torch.Tensor, str]]:
    yield from _decode(request.param)


# Over tcp our own listener takes the fence (tests/transfer/test_fences.py covers it in-process): slow.
@pytest.fixture(params=["shm", pytest.param("tcp", marks=pytest.mark.slow)])
def fenced_decode(request: pytest.FixtureRequest) -> Iterator[tuple[RecvBuffer, torch.Tensor, str]]:
    yield from _decode(request.param)


def test_handshake_and_pull_across_processes(decode) -> None:
    recv, pool, backend = decode
    port = free_port()
    proc = start_prefill(port, "--seed", "11", "--publish", "a:2,9,4:777", backend=backend)
    try:
        # Pulled only if the handshake names the engine the child runs.
        recv.request_pull("a", "127.0.0.1", port, [1, 2, 3], peer_engine_id="prefill-proc")
        status = wait_terminal(recv, "a")
        assert status.state is PullState.DONE and status.output_token == 777, status
        assert torch.equal(pool[:, :, [1, 2, 3]], seeded(LAYOUT, 11)[:, :, [2, 9, 4]])
        wait_until(lambda: "RELEASED a" in proc.output(), timeout=10, what="release in the prefill")
    finally:
        proc.stop()


def test_layout_mismatch_fails_the_pull() -> None:
    engine, _ = engine_with_pool("shm")
    recv = RecvBuffer(engine, LAYOUT, engine_id="127.0.0.1:8201")
    recv.start()
    port = free_port()
    proc = start_prefill(port, "--head-dim", "16")
    try:
        # The pull fails with a clear error, long before its deadline.
        recv.request_pull("m", "127.0.0.1", port, [0], deadline_s=60)
        status = wait_terminal(recv, "m", timeout=20)
        assert isinstance(status.error, LayoutMismatch) and "head_dim: 16 != 8" in status.message
    finally:
        proc.stop()
        recv.close()
        engine.close()


# tcp with --full: the restart and reconnect are the signal plane's, the same over either transport.
@pytest.mark.parametrize("decode", ["shm", pytest.param("tcp", marks=pytest.mark.slow)], indirect=True)
def test_prefill_restart_reconnects_and_pulls_again(decode) -> None:
    recv, pool, backend = decode
    port = free_port()
    first = start_prefill(port, "--seed", "1", "--publish", "a:1:10", backend=backend)
    try:
        recv.request_pull("a", "127.0.0.1", port, [0])
        assert wait_terminal(recv, "a").output_token == 10
        recv.request_pull("never", "127.0.0.1", port, [4], deadline_s=60)   # the prefill never publishes it
        killed = time.monotonic()
        kill9_and_reap(first)
        # Its connection is lost at once: the pull fails then, not at its deadline.
        status = wait_terminal(recv, "never", timeout=10)
        print(f"pull failed {time.monotonic() - killed:.2f} s after the prefill was killed")
        assert isinstance(status.error, PeerUnavailable) and "was lost" in status.message, status
    finally:
        first.stop()
    # A new process at the same address: the link handshakes with it before it pulls.
    second = start_prefill(port, "--seed", "2", "--publish", "b:5,6:20", "--publish", "c:3:30",
                           "--engine-id", "prefill-proc-2", backend=backend)
    try:
        recv.request_pull("b", "127.0.0.1", port, [7, 8])
        status = wait_terminal(recv, "b")
        assert status.state is PullState.DONE and status.output_token == 20, status
        assert torch.equal(pool[:, :, [7, 8]], seeded(LAYOUT, 2)[:, :, [5, 6]])
        assert torch.equal(pool[:, :, 0], seeded(LAYOUT, 1)[:, :, 1])
        # The link's handshake is now the new process's; a pull naming the old one is refused.
        recv.request_pull("c", "127.0.0.1", port, [9], peer_engine_id="prefill-proc")
        status = wait_terminal(recv, "c")
        assert isinstance(status.error, EngineMismatch), status
        assert status.message.endswith(f"expected prefill engine prefill-proc at 127.0.0.1:{port}, "
                                       "found prefill-proc-2")
        assert not pool[:, :, 9].any()
    finally:
        second.stop()


def test_a_prefill_frozen_through_the_handshake_still_serves_the_pull() -> None:
    """A contended host: the prefill's signal plane gets no CPU for seconds while decode resends its
    handshake every second; once it runs again the link comes up and the pull completes."""
    engine, pool = engine_with_pool("shm")
    recv = RecvBuffer(engine, LAYOUT, engine_id="127.0.0.1:8202", default_timeout=20.0)
    recv.start()
    port = free_port()
    proc = start_prefill(port, "--seed", "5", "--publish", "h:3,4:55")
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            recv.request_pull("h", "127.0.0.1", port, [5, 6])
            time.sleep(4)   # the frozen stretch itself, not a synchronisation: four resent handshakes queue up
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        status = wait_terminal(recv, "h")
        assert status.state is PullState.DONE and status.output_token == 55, status
        assert torch.equal(pool[:, :, [5, 6]], seeded(LAYOUT, 5)[:, :, [3, 4]])
    finally:
        proc.stop()
        recv.close()
        engine.close()


def test_a_prefill_frozen_past_the_heartbeat_never_writes_into_blocks_reused_since(fenced_decode) -> None:
    """The prefill freezes (SIGSTOP) with a lookup of ours in its socket buffer; we fail that pull at the
    heartbeat timeout and reuse its blocks for a pull from another prefill. Resumed, the frozen one pushes
    into those blocks under the old handoff's generation: the write is refused, they keep the new KV."""
    recv, pool, backend = fenced_decode
    port, other_port = free_port(), free_port()
    frozen = start_prefill(port, "--seed", "11", "--publish", "w:1:1", "--publish", "stale:2,9,4:777",
                           backend=backend)
    other = start_prefill(other_port, "--seed", "22", "--publish", "fresh:5,6,7:555",
                          "--engine-id", "prefill-other", backend=backend)
    try:
        recv.request_pull("w", "127.0.0.1", port, [10])   # the session and the transfer link are up
        assert wait_terminal(recv, "w").state is PullState.DONE
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            recv.request_pull("stale", "127.0.0.1", port, [1, 2, 3], deadline_s=60)
            status = wait_terminal(recv, "stale", timeout=15)
            assert isinstance(status.error, PeerUnavailable), status
            recv.request_pull("fresh", "127.0.0.1", other_port, [1, 2, 3])
            assert wait_terminal(recv, "fresh").output_token == 555
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        wait_until(lambda: "RELEASED stale" in frozen.output(), timeout=15, what="the stale push to end")
        assert torch.equal(pool[:, :, [1, 2, 3]], seeded(LAYOUT, 22)[:, :, [5, 6, 7]])
        assert re.search(r"transfer of 'stale' failed: .*for handoff \d+", frozen.output()), frozen.output()[-2000:]
        assert recv._engine.fences.closed()   # no block open, nothing quarantined: all back to the pool
    finally:
        frozen.stop()
        other.stop()
