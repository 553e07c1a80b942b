"""The two hot loops under the transports: many-range memcpy, and scatter-gather socket I/O."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from transfer import memcopy
from transfer.blocks import Ranges
from transfer.errors import PeerLost
from transfer.sockio import deadline_in, iovecs, recv_ranges, resume, send_ranges


def scattered(rng: np.random.Generator, count: int, size: int) -> tuple[Ranges, Ranges]:
    """Source and destination ranges of odd lengths, in shuffled order on both sides."""
    lengths = rng.integers(1, size, count)
    slots = np.arange(count, dtype=np.int64) * size
    return (Ranges(rng.permutation(slots), lengths.astype(np.int64)),
            Ranges(rng.permutation(slots), lengths.astype(np.int64)))


def expected(src: np.ndarray, dst: np.ndarray, src_r: Ranges, dst_r: Ranges) -> np.ndarray:
    out = dst.copy()
    for s, d, n in zip(src_r.offsets, dst_r.offsets, src_r.lengths):
        out[d:d + n] = src[s:s + n]
    return out


COPIES = [memcopy.python_copy_ranges] + ([memcopy.copy_ranges] if memcopy.NATIVE else [])


@pytest.mark.parametrize("copy", COPIES, ids=lambda f: f.__name__)
def test_copy_ranges_moves_exactly_the_ranges(copy) -> None:
    rng = np.random.default_rng(1)
    src_r, dst_r = scattered(rng, 500, 300)
    src = rng.integers(0, 256, 500 * 300, dtype=np.uint8)
    dst = rng.integers(0, 256, 500 * 300, dtype=np.uint8)
    want = expected(src, dst, src_r, dst_r)
    copy(dst.ctypes.data, src.ctypes.data, dst_r.offsets, src_r.offsets, src_r.lengths)
    assert np.array_equal(dst, want)


def test_copy_ranges_refuses_unequal_arrays() -> None:
    buf = np.zeros(16, dtype=np.uint8)
    with pytest.raises(ValueError, match="one length"):
        memcopy.copy_ranges(buf.ctypes.data, buf.ctypes.data, np.array([0]), np.array([0, 8]), np.array([4]))


def test_resume_cuts_a_half_moved_range() -> None:
    ranges = Ranges(np.array([100, 0, 50], dtype=np.int64), np.array([10, 20, 30], dtype=np.int64))
    iov, ends = iovecs(1000, ranges), np.cumsum(ranges.lengths)
    assert resume(iov, 1000, ranges, ends, 10) == 1 and iov[1].tolist() == [1000, 20]
    assert resume(iov, 1000, ranges, ends, 17) == 1 and iov[1].tolist() == [1007, 13]
    assert resume(iov, 1000, ranges, ends, 59) == 2 and iov[2].tolist() == [1079, 1]
    assert resume(iov, 1000, ranges, ends, 60) == 3


def test_scatter_gather_socket_io_lands_every_byte() -> None:
    """More ranges than one sendmsg takes (IOV_MAX), of odd sizes, through a small socket buffer."""
    rng = np.random.default_rng(2)
    src_r, dst_r = scattered(rng, 3000, 700)
    src = rng.integers(0, 256, 3000 * 700, dtype=np.uint8)
    dst = np.zeros_like(src)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            recv_ranges(b, dst.ctypes.data, dst_r, deadline_in(30))
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    receiver = threading.Thread(target=receive)
    receiver.start()
    send_ranges(a, src.ctypes.data, src_r, deadline_in(30))
    receiver.join(30)
    a.close(), b.close()
    assert not errors and not receiver.is_alive()
    assert np.array_equal(dst, expected(src, np.zeros_like(src), src_r, dst_r))


def test_peer_closing_mid_receive_is_peer_lost() -> None:
    a, b = socket.socketpair()
    buf = np.zeros(4096, dtype=np.uint8)
    a.sendall(b"x" * 100)
    a.close()
    with pytest.raises(PeerLost, match="closed"):
        recv_ranges(b, buf.ctypes.data, Ranges(np.array([0], dtype=np.int64), np.array([4096], dtype=np.int64)),
                    deadline_in(10))
    b.close()


def test_ranges_come_in_batches_of_whole_ranges_in_order() -> None:
    ranges = Ranges(np.array([0, 100, 50, 400, 900], dtype=np.int64), np.array([10, 40, 60, 500, 5], dtype=np.int64))
    batches = list(ranges.batches(100))
    assert [b.lengths.tolist() for b in batches] == [[10, 40], [60], [500], [5]]
    assert np.concatenate([b.offsets for b in batches]).tolist() == ranges.offsets.tolist()
    assert list(Ranges(np.zeros(0, np.int64), np.zeros(0, np.int64)).batches(100)) == []
