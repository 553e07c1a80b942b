"""A transfer engine in a child process, driven over a multiprocessing pipe by the tests."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from tests.helpers import wait_until


def fill(pool: torch.Tensor, seed: int) -> None:
    """Deterministic random bytes, so the test can recompute what any block holds."""
    gen = torch.Generator().manual_seed(seed)
    flat = pool.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def block_bytes(pool: torch.Tensor, ids: list[int]) -> bytes:
    return pool[:, :, ids].contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _handle(engine: Any, pool: torch.Tensor, cmd: str, args: tuple) -> Any:
    if cmd == "descriptor":
        return engine.descriptor()
    if cmd == "connect":
        return engine.connect(args[0])
    if cmd == "transfer":  # (peer, src, dst, timeout) -> None or (error type, message)
        token = engine.queue_transfer_with_token(*args[:3], timeout=args[3])
        try:
            token.wait(args[3] + 5)
        except Exception as exc:  # noqa: BLE001 - reported to the test as data
            return type(exc).__name__, str(exc)
        return None
    if cmd == "dump":
        return block_bytes(pool, args[0])
    if cmd == "unregister":
        return engine.unregister_region()
    raise ValueError(cmd)


def peer_main(conn: Connection, backend: str, layout: dict[str, Any], seed: int) -> None:
    from transfer import KVLayout, create_transfer_engine
    torch.set_num_threads(1)
    engine = create_transfer_engine(backend)
    pool = engine.allocate_region(KVLayout.from_dict(layout))
    fill(pool, seed)
    conn.send(("ready", os.getpid()))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "close":
                break
            try:
                conn.send(("ok", _handle(engine, pool, cmd, tuple(args))))
            except Exception as exc:  # noqa: BLE001
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        engine.close()
        conn.send(("closed", None))


def _allocate_and_return(layout: dict[str, Any]) -> None:
    from transfer import KVLayout, create_transfer_engine
    create_transfer_engine("shm").allocate_region(KVLayout.from_dict(layout))


def exit_without_close(layout: dict[str, Any]) -> Any:
    """Runs a process that allocates an shm pool and exits normally without close()."""
    proc = _context().Process(target=_allocate_and_return, args=(layout,))
    proc.start()
    proc.join(60)
    return proc


def _context() -> Any:
    # A fork server with torch preloaded starts each peer in milliseconds instead of
    # re-importing torch; the server itself never runs torch ops, so forking it is safe.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transfer", "tests.transfer.peer_proc"])
    return ctx


@dataclass
class PeerProcess:
    """The test's handle on one peer process; `stop` always leaves no process behind."""

    proc: Any
    conn: Connection
    pid: int

    @classmethod
    def start(cls, backend: str, layout: dict[str, Any], seed: int) -> PeerProcess:
        ctx = _context()
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=peer_main, args=(theirs, backend, layout, seed), daemon=True)
        proc.start()
        theirs.close()
        if not ours.poll(60):
            proc.kill()
            raise AssertionError("peer process did not start")
        status, pid = ours.recv()
        assert status == "ready"
        return cls(proc, ours, pid)

    def call(self, cmd: str, *args: Any, timeout: float = 30.0) -> Any:
        self.conn.send((cmd, *args))
        if not self.conn.poll(timeout):
            raise AssertionError(f"peer did not answer {cmd!r} in {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"peer failed {cmd!r}: {value}")
        return value

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        """Closes the engine cleanly when the process still answers, else kills it."""
        if self.proc.is_alive():
            self.resume()
            try:
                self.conn.send(("close",))
                wait_until(lambda: self.conn.poll(0) or not self.proc.is_alive(),
                           timeout=15, what="peer close")
            except (OSError, AssertionError):
                pass
        self.kill()
        self.conn.close()
