"""Blocking socket I/O against a deadline, straight from and into memory.

Small frames go through memoryviews. Pool ranges go through libc's sendmsg/recvmsg with
iovec arrays built by numpy: a transfer has thousands of chunks, and a Python buffer
object per chunk would cost more than moving its bytes (and stall on garbage collection).

Socket errors are translated here, at the boundary: a timeout becomes TransferTimeout,
a reset, a broken pipe or an early EOF becomes PeerLost.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from transfer.backend import remaining
from transfer.blocks import Ranges
from transfer.errors import PeerLost, TransferTimeout

# Linux caps one sendmsg/recvmsg at 1024 buffers (IOV_MAX).
IOV_MAX = 1024
# Bytes a receive that reports its progress takes at most per call: the receiver's check of
# what landed (transfer.landing) follows this closely.
_LANDED_STEP = 2 << 20
# Kernel buffers that hold a whole push of a few MB: the sender copies it out in one sendmsg
# instead of sleeping and waking once per window's worth, and the receiver wakes once per
# batch. Under load every such wake-up takes a core from the engine's compute threads (a
# preempted intra-op thread stalls the whole parallel op), so the prefill engine slows with
# the number of wake-ups, not the bytes. Set only where the host allows that much
# (net.core.wmem_max / rmem_max); below it the kernel's autotuning grows them further.
PUSH_BUFFER_BYTES = 4 << 20
_CORE_MAX = {socket.SO_SNDBUF: "/proc/sys/net/core/wmem_max", socket.SO_RCVBUF: "/proc/sys/net/core/rmem_max"}


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

    Blocking calls with SO_SNDTIMEO/SO_RCVTIMEO let one sendmsg or recvmsg(WAITALL)
    move a whole batch of ranges; Python's own timeouts would return after every partial
    write and cost a Python round trip per socket-buffer's worth of bytes.
    """
    # A zero timeval would mean "no timeout": a live deadline gets at least 1 us.
    micros = 0 if deadline is None else max(1, int(remaining(deadline) * 1e6))
    seconds, micros = divmod(micros, 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", seconds, micros))


def tune(sock: socket.socket) -> socket.socket:
    """No Nagle delay on headers and replies; kernel buffers for whole pushes where allowed.

    On a listener, call it before connections arrive: accepted ones inherit the receive
    buffer, and the window scale they announce is chosen from it during the handshake."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option, path in _CORE_MAX.items():
        if _sysctl(path) >= PUSH_BUFFER_BYTES:
            sock.setsockopt(socket.SOL_SOCKET, option, PUSH_BUFFER_BYTES)
    return sock


def _sysctl(path: str) -> int:
    try:
        return int(Path(path).read_text())
    except (OSError, ValueError):
        return 0


def blocking(sock: socket.socket) -> socket.socket:
    sock.settimeout(None)
    return sock


def send_bytes(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Sends a small frame (a header, a reply)."""
    with translated("send"):
        _arm(sock, socket.SO_SNDTIMEO, deadline)
        sock.sendall(data)


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    """Fills `view`; None waits without limit (an idle connection between frames)."""
    with translated("receive"):
        while view.nbytes:
            _arm(sock, socket.SO_RCVTIMEO, deadline)
            got = sock.recv_into(view, 0, socket.MSG_WAITALL)
            if got == 0:
                raise PeerLost("peer closed the connection mid-transfer")
            view = view[got:]


def recv_bytes(sock: socket.socket, nbytes: int, deadline: float | None) -> bytes:
    buf = bytearray(nbytes)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def drain(sock: socket.socket, nbytes: int, deadline: float) -> None:
    """Reads and drops `nbytes`, keeping the stream in step after a rejected request."""
    scratch = memoryview(bytearray(1 << 20))
    while nbytes:
        n = min(nbytes, len(scratch))
        recv_into(sock, scratch[:n], deadline)
        nbytes -= n


class _MsgHdr(ctypes.Structure):
    """Linux `struct msghdr`."""

    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.c_void_p), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


def _libc_call(name: str) -> Callable[..., int]:
    call = getattr(ctypes.CDLL(None, use_errno=True), name)
    call.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
    call.restype = ctypes.c_ssize_t
    return call


_SENDMSG, _RECVMSG = _libc_call("sendmsg"), _libc_call("recvmsg")


def send_ranges(sock: socket.socket, base: int, ranges: Ranges, deadline: float) -> None:
    """Sends the bytes at base + ranges, in order, with scatter-gather sendmsg calls."""
    _move(_SENDMSG, socket.MSG_NOSIGNAL, socket.SO_SNDTIMEO, "send", sock, base, ranges, deadline)


def recv_ranges(sock: socket.socket, base: int, ranges: Ranges, deadline: float,
                on_landed: Callable[[int], None] | None = None) -> None:
    """Fills base + ranges, in order, with scatter recvmsg calls: no intermediate copy. With
    `on_landed`, calls it with the bytes in place so far after every receive of at most
    _LANDED_STEP bytes."""
    _move(_RECVMSG, socket.MSG_WAITALL, socket.SO_RCVTIMEO, "receive", sock, base, ranges, deadline, on_landed)


def iovecs(base: int, ranges: Ranges) -> np.ndarray:
    """`struct iovec` array ({address, length} as two uint64) for the ranges at `base`."""
    iov = np.empty((len(ranges), 2), dtype=np.uint64)
    iov[:, 0] = base + ranges.offsets
    iov[:, 1] = ranges.lengths
    return iov


def resume(iov: np.ndarray, base: int, ranges: Ranges, ends: np.ndarray, done: int) -> int:
    """After `done` bytes moved in all, the index of the first iovec still to move; the
    iovec is cut to its unmoved tail when the last call stopped in the middle of it."""
    first = int(np.searchsorted(ends, done, side="right"))
    if first < len(iov):
        start = int(ends[first] - ranges.lengths[first])
        if start < done:
            iov[first] = (base + int(ranges.offsets[first]) + done - start, int(ends[first]) - done)
    return first


def _move(call: Callable[..., int], flags: int, option: int, what: str, sock: socket.socket,
          base: int, ranges: Ranges, deadline: float, on_moved: Callable[[int], None] | None = None) -> None:
    iov, ends = iovecs(base, ranges), np.cumsum(ranges.lengths)
    msg, done, first = _MsgHdr(), 0, 0
    with translated(what):
        while first < len(iov):
            _arm(sock, option, deadline)
            stop = len(iov) if on_moved is None else int(np.searchsorted(ends, done + _LANDED_STEP, side="right"))
            msg.msg_iov = iov.ctypes.data + first * iov.strides[0]
            msg.msg_iovlen = min(IOV_MAX, max(1, stop - first), len(iov) - first)
            moved = call(sock.fileno(), ctypes.byref(msg), flags)
            if moved < 0:
                code = ctypes.get_errno()
                if code == errno.EINTR:
                    continue
                raise OSError(code, os.strerror(code))  # its errno subclass: `translated` maps it
            if moved == 0:
                raise PeerLost("peer closed the connection mid-transfer")
            done += moved
            first = resume(iov, base, ranges, ends, done)
            if on_moved is not None:
                on_moved(done)


def deadline_in(seconds: float) -> float:
    return time.monotonic() + seconds
