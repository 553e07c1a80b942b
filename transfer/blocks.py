"""Sans-I/O block planning: validate block id pairs, merge adjacent ones into runs, and
turn runs into byte ranges of a pool laid out as in KVLayout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from transfer.errors import InvalidBlocks
from transfer.layout import KVLayout


class Run(NamedTuple):
    """`count` adjacent blocks starting at `local` on this side and `remote` on the peer."""

    local: int
    remote: int
    count: int


def plan_runs(local_ids: Sequence[int], remote_ids: Sequence[int],
              local_blocks: int, remote_blocks: int) -> list[Run]:
    """Pairs local_ids[i] with remote_ids[i] and merges pairs adjacent on both sides.

    Pairs are sorted by local id first, so ids listed out of order still merge; the runs
    come back sorted by the peer's blocks, the destination of a push, so that every backend
    writes front to back. Raises InvalidBlocks on unequal lengths, out-of-range or repeated ids.
    """
    if len(local_ids) != len(remote_ids):
        raise InvalidBlocks(f"{len(local_ids)} source ids but {len(remote_ids)} destination ids")
    local = _checked_ids(local_ids, local_blocks, "local")
    remote = _checked_ids(remote_ids, remote_blocks, "peer")
    order = np.argsort(local, kind="stable")
    local, remote = local[order], remote[order]
    # A run starts wherever either side is not the previous block + 1.
    starts = np.flatnonzero(np.diff(local, prepend=-2) != 1) if len(local) else local
    starts = np.union1d(starts, np.flatnonzero(np.diff(remote, prepend=-2) != 1))
    counts = np.diff(starts, append=len(local))
    firsts = np.stack([local[starts], remote[starts], counts])
    firsts = firsts[:, np.argsort(firsts[1], kind="stable")]
    return [Run(*run) for run in firsts.T.tolist()]


def _checked_ids(ids: Sequence[int], num_blocks: int, side: str) -> np.ndarray:
    array = np.asarray(ids)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise InvalidBlocks(f"{side} block ids must be a flat sequence of integers, not {array.dtype}")
    array = array.astype(np.int64)
    bad = array[(array < 0) | (array >= num_blocks)]
    if bad.size:
        raise InvalidBlocks(f"{side} block ids out of range [0, {num_blocks}): {bad[:8].tolist()}")
    if np.unique(array).size != array.size:
        raise InvalidBlocks(f"repeated {side} block ids")
    return array


@dataclass(frozen=True, eq=False)
class Ranges:
    """Byte ranges within a pool, as two int64 arrays: a transfer has thousands of them,
    so they never become one Python object each."""

    offsets: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def pairs(self) -> list[tuple[int, int]]:
        """(offset, nbytes) tuples, for APIs that take lists."""
        return list(zip(self.offsets.tolist(), self.lengths.tolist()))

    def batches(self, max_bytes: int) -> Iterator[Ranges]:
        """Consecutive groups of whole ranges, in order, each of at most `max_bytes` (a longer
        range is a group alone)."""
        ends = np.cumsum(self.lengths)
        start = 0
        while start < len(self):
            before = int(ends[start - 1]) if start else 0
            stop = max(start + 1, int(np.searchsorted(ends, before + max_bytes, side="right")))
            yield Ranges(self.offsets[start:stop], self.lengths[start:stop])
            start = stop


def byte_ranges(layout: KVLayout, starts: Sequence[int], counts: Sequence[int]) -> Ranges:
    """The pool's byte ranges for the runs of `counts` blocks from `starts`, plane by plane.

    Both sides of a transfer walk the same runs in the same order and every (plane, run)
    range has the same length on both sides, so the i-th range here matches the peer's
    i-th range. Planes go outermost so that, with runs sorted by destination block, the
    destination is written front to back: scattered writes copy about 30% slower.
    """
    first = np.asarray(starts, dtype=np.int64)
    count = np.asarray(counts, dtype=np.int64)
    planes = np.arange(layout.num_planes, dtype=np.int64)[:, None] * layout.num_blocks
    chunk = layout.plane_chunk_bytes
    offsets = ((planes + first) * chunk).ravel()
    lengths = np.broadcast_to(count * chunk, (len(planes), len(count))).ravel()
    return Ranges(offsets, np.ascontiguousarray(lengths))


def local_ranges(layout: KVLayout, runs: Sequence[Run]) -> Ranges:
    return byte_ranges(layout, [r.local for r in runs], [r.count for r in runs])


def remote_ranges(layout: KVLayout, runs: Sequence[Run]) -> Ranges:
    return byte_ranges(layout, [r.remote for r in runs], [r.count for r in runs])
