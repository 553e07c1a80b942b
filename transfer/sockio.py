"""Blocking socket I/O against a deadline, straight from and into memoryviews.

Socket errors are translated here, at the boundary: a timeout becomes TransferTimeout,
a reset, a broken pipe or an early EOF becomes PeerLost.
"""
from __future__ import annotations

import socket
import struct
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator, Sequence

from transfer.backend import remaining
from transfer.errors import PeerLost, TransferTimeout

# Linux caps one sendmsg/recvmsg at 1024 buffers (IOV_MAX).
IOV_MAX = 1024


@contextmanager
def translated(what: str) -> Iterator[None]:
    try:
        yield
    except (socket.timeout, BlockingIOError) as exc:  # SO_*TIMEO expiry surfaces as EAGAIN
        raise TransferTimeout(f"{what}: peer did not answer in time") from exc
    except OSError as exc:
        raise PeerLost(f"{what}: {exc}") from exc


def _arm(sock: socket.socket, option: int, deadline: float | None) -> None:
    """Kernel-side timeout for the next blocking call; 0 means wait forever.

    Blocking calls with SO_SNDTIMEO/SO_RCVTIMEO let one sendmsg or recvmsg_into(WAITALL)
    move a whole batch of views; Python's own timeouts would return after every partial
    write and cost a Python round trip per socket-buffer's worth of bytes.
    """
    left = 0.0 if deadline is None else max(remaining(deadline), 1e-6)
    seconds = int(left)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", seconds, int((left - seconds) * 1e6)))


def blocking(sock: socket.socket) -> socket.socket:
    sock.settimeout(None)
    return sock


def send_views(sock: socket.socket, views: Sequence[memoryview], deadline: float) -> None:
    """Sends all `views` in order with scatter-gather sendmsg calls."""
    pending = deque(v.cast("B") for v in views if v.nbytes)
    with translated("send"):
        while pending:
            _arm(sock, socket.SO_SNDTIMEO, deadline)
            sent = sock.sendmsg([pending[i] for i in range(min(IOV_MAX, len(pending)))])
            _advance(pending, sent)


def recv_views(sock: socket.socket, views: Sequence[memoryview], deadline: float | None) -> None:
    """Fills all `views` in order with scatter recvmsg_into calls, no intermediate copy."""
    pending = deque(v.cast("B") for v in views if v.nbytes)
    with translated("receive"):
        while pending:
            _arm(sock, socket.SO_RCVTIMEO, deadline)
            batch = [pending[i] for i in range(min(IOV_MAX, len(pending)))]
            got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
            if got == 0:
                raise PeerLost("peer closed the connection mid-transfer")
            _advance(pending, got)


def recv_bytes(sock: socket.socket, nbytes: int, deadline: float | None) -> bytes:
    buf = bytearray(nbytes)
    recv_views(sock, [memoryview(buf)], deadline)
    return bytes(buf)


def drain(sock: socket.socket, nbytes: int, deadline: float) -> None:
    """Reads and drops `nbytes`, keeping the stream in step after a rejected request."""
    scratch = memoryview(bytearray(1 << 20))
    while nbytes:
        n = min(nbytes, len(scratch))
        recv_views(sock, [scratch[:n]], deadline)
        nbytes -= n


def _advance(pending: deque[memoryview], nbytes: int) -> None:
    while nbytes:
        head = pending[0]
        if nbytes >= head.nbytes:
            nbytes -= head.nbytes
            pending.popleft()
        else:
            pending[0] = head[nbytes:]
            nbytes = 0


def deadline_in(seconds: float) -> float:
    return time.monotonic() + seconds
