"""Copies many byte ranges between two addresses of this process.

The native loop (transfer/_memcopy.c, compiled when the package is installed) makes one
call per transfer plane and releases the GIL; without a C compiler at install time the
package falls back to one ctypes.memmove per range: the same bytes, slower with small
chunks.
"""
from __future__ import annotations

import ctypes

import numpy as np

try:
    from transfer._memcopy import copy_ranges as _native_copy_ranges
except ImportError:  # built without a C compiler
    _native_copy_ranges = None

NATIVE = _native_copy_ranges is not None


def copy_ranges(dst: int, src: int, dst_offsets: np.ndarray, src_offsets: np.ndarray,
                lengths: np.ndarray) -> None:
    """memmove(dst + dst_offsets[i], src + src_offsets[i], lengths[i]) for every i."""
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (dst_offsets, src_offsets, lengths)]
    if not len(arrays[0]) == len(arrays[1]) == len(arrays[2]):
        raise ValueError("offsets and lengths must have one length")
    if _native_copy_ranges is not None:
        _native_copy_ranges(dst, src, *arrays)
    else:
        python_copy_ranges(dst, src, *arrays)


def python_copy_ranges(dst: int, src: int, dst_offsets: np.ndarray, src_offsets: np.ndarray,
                       lengths: np.ndarray) -> None:
    """The fallback: one ctypes.memmove (which releases the GIL) per range."""
    move = ctypes.memmove
    for d, s, n in zip(dst_offsets.tolist(), src_offsets.tolist(), lengths.tolist()):
        move(dst + d, src + s, n)
