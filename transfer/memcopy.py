"""Copies and checksums many byte ranges between two addresses of this process.

The native loop (transfer/_memcopy.c, compiled when the package is installed) makes one
call per transfer plane and releases the GIL; it copies a range and extends its CRC-32C
in the same pass (carry-less multiplication on 512-bit lanes where the CPU has AVX-512
VPCLMULQDQ, else the crc32 instruction on x86-64, else a table), so a checked copy reads
memory once. Without a C compiler at install time the package falls back to one
ctypes.memmove per range and the `crc32c` package's CRC-32C over each: the same bytes and
values, slower.
"""
from __future__ import annotations

import ctypes

import crc32c
import numpy as np

try:
    from transfer._memcopy import copy_ranges as _native_copy_ranges
    from transfer._memcopy import copy_ranges_crc32c as _native_copy_crc32c
    from transfer._memcopy import crc32c_path as _native_crc32c_path
    from transfer._memcopy import crc32c_ranges as _native_crc32c_ranges
    from transfer._memcopy import mark as _native_mark
except ImportError:  # built without a C compiler
    _native_copy_ranges = _native_copy_crc32c = _native_crc32c_ranges = _native_crc32c_path = None
    _native_mark = None

NATIVE = _native_copy_ranges is not None
# The native loop's ways to compute CRC-32C, slowest first; a CPU runs a prefix of them.
CRC32C_PATHS = ("table", "sse4.2", "vpclmulqdq")


def _int64(*arrays: np.ndarray) -> list[np.ndarray]:
    out = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
    if len({len(a) for a in out}) > 1:
        raise ValueError("offsets and lengths must have one length")
    return out


def copy_ranges(dst: int, src: int, dst_offsets: np.ndarray, src_offsets: np.ndarray,
                lengths: np.ndarray, mark: int = 0, mark_base: int = 0) -> None:
    """memmove(dst + dst_offsets[i], src + src_offsets[i], lengths[i]) for every i. With the
    address of a landing `mark` (transfer.landing), raises it to `mark_base` + the bytes copied
    as the copy goes (the native loop only)."""
    arrays = _int64(dst_offsets, src_offsets, lengths)
    if _native_copy_ranges is not None:
        _native_copy_ranges(dst, src, *arrays, mark, mark_base)
    else:
        python_copy_ranges(dst, src, *arrays)


def copy_ranges_crc32c(dst: int, src: int, dst_offsets: np.ndarray, src_offsets: np.ndarray,
                       lengths: np.ndarray, crc: int = 0, mark: int = 0, mark_base: int = 0) -> int:
    """As copy_ranges (ranges must not overlap), and returns `crc` extended by the CRC-32C of
    the bytes copied, range after range."""
    arrays = _int64(dst_offsets, src_offsets, lengths)
    if _native_copy_crc32c is not None:
        return _native_copy_crc32c(dst, src, *arrays, crc, mark, mark_base)
    python_copy_ranges(dst, src, *arrays)
    return crc32c_ranges(src, arrays[1], arrays[2], crc)


def crc32c_ranges(base: int, offsets: np.ndarray, lengths: np.ndarray, crc: int = 0) -> int:
    """`crc` extended by the CRC-32C of the bytes at base + offsets[i], lengths[i], in order."""
    offsets, lengths = _int64(offsets, lengths)
    if _native_crc32c_ranges is not None:
        return _native_crc32c_ranges(base, offsets, lengths, crc)
    for offset, length in zip(offsets.tolist(), lengths.tolist()):
        crc = crc32c.crc32c((ctypes.c_char * length).from_address(base + offset), crc)
    return crc


def mark_word(address: int, value: int = -1) -> int:
    """The int64 landing mark at `address` (transfer.landing), read after every store before it; with
    a `value` >= 0, stores it first, ordered after every store before it. Needs the native loop."""
    if _native_mark is None:
        raise RuntimeError("landing marks need the native loop (transfer._memcopy)")
    return _native_mark(address, value)


def crc32c_path(name: str | None = None) -> str | None:
    """The native loop's CRC-32C in use (None without the native loop); with `name` (one of
    CRC32C_PATHS), switches to it first, or raises ValueError when this CPU cannot run it.
    Every path gives the same values: this is for tests and benchmarks."""
    if _native_crc32c_path is None:
        return None
    if name is not None and _native_crc32c_path(CRC32C_PATHS.index(name)) < 0:
        raise ValueError(f"this CPU cannot run the {name} CRC-32C")
    return CRC32C_PATHS[_native_crc32c_path()]


def python_copy_ranges(dst: int, src: int, dst_offsets: np.ndarray, src_offsets: np.ndarray,
                       lengths: np.ndarray) -> None:
    """The fallback: one ctypes.memmove (which releases the GIL) per range."""
    move = ctypes.memmove
    for d, s, n in zip(dst_offsets.tolist(), src_offsets.tolist(), lengths.tolist()):
        move(dst + d, src + s, n)
