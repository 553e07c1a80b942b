"""Sans-I/O block planning: validate block id pairs, merge adjacent ones into runs, and
turn runs into byte ranges of a pool laid out as in KVLayout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from transfer.errors import InvalidBlocks
from transfer.layout import KVLayout


@dataclass(frozen=True, slots=True)
class Run:
    """`count` adjacent blocks starting at `local` on this side and `remote` on the peer."""

    local: int
    remote: int
    count: int


def plan_runs(local_ids: Sequence[int], remote_ids: Sequence[int],
              local_blocks: int, remote_blocks: int, by_remote: bool = False) -> list[Run]:
    """Pairs local_ids[i] with remote_ids[i] and merges pairs adjacent on both sides.

    Pairs are sorted by local id first, so ids listed out of order still merge; the runs
    come back in local order, and `by_remote=True` re-sorts them by the peer's blocks.
    Raises InvalidBlocks on unequal lengths, out-of-range or repeated ids.
    """
    if len(local_ids) != len(remote_ids):
        raise InvalidBlocks(f"{len(local_ids)} source ids but {len(remote_ids)} destination ids")
    _check_ids(local_ids, local_blocks, "local")
    _check_ids(remote_ids, remote_blocks, "peer")
    runs: list[Run] = []
    for local, remote in sorted(zip(local_ids, remote_ids)):
        last = runs[-1] if runs else None
        if last and local == last.local + last.count and remote == last.remote + last.count:
            runs[-1] = Run(last.local, last.remote, last.count + 1)
        else:
            runs.append(Run(local, remote, 1))
    if by_remote:
        runs.sort(key=lambda run: run.remote)
    return runs


def _check_ids(ids: Sequence[int], num_blocks: int, side: str) -> None:
    bad = [b for b in ids if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_blocks]
    if bad:
        raise InvalidBlocks(f"{side} block ids out of range [0, {num_blocks}): {bad[:8]}")
    if len(set(ids)) != len(ids):
        raise InvalidBlocks(f"repeated {side} block ids")


def byte_ranges(layout: KVLayout, starts: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """(offset, nbytes) within the pool for each (first block, count), plane by plane.

    Both sides of a transfer walk the same runs in the same order and every (plane, run)
    range has the same length on both sides, so the i-th range here matches the peer's
    i-th range. Planes go outermost so that, with runs sorted by destination block, the
    destination is written front to back: scattered writes copy about 30% slower.
    """
    chunk = layout.chunk_bytes
    for plane in range(2 * layout.num_layers):
        base = plane * layout.num_blocks
        for start, count in starts:
            yield (base + start) * chunk, count * chunk


def local_ranges(layout: KVLayout, runs: Sequence[Run]) -> list[tuple[int, int]]:
    return list(byte_ranges(layout, [(r.local, r.count) for r in runs]))


def remote_ranges(layout: KVLayout, runs: Sequence[Run]) -> list[tuple[int, int]]:
    return list(byte_ranges(layout, [(r.remote, r.count) for r in runs]))
