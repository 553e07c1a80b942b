"""Handoff fences: which handoff may write into each block of a pool, decided before a byte lands.

The receiving side (decode) tags every pull with a fresh generation and `open`s its destination
blocks for it; whoever writes into those blocks (the prefill's copy loop over shm, our own tcp
listener's receive) first `acquire`s them for the generation it was given, and `release`s them
once its bytes are in. One int64 word per block, changed only by compare-and-swap (transfer
._memcopy.fence), in the shared-memory segment when the pool is shared, so both processes race
on the same words:

    closed --open(g)--> OPEN(g) --acquire(g)--> BUSY(g) --release(g)--> OPEN(g) --close(g)--> closed
                                                BUSY(g) --close(g)--> REVOKED(g) --release(g)--> closed

Invariant: a byte of handoff g is written into a block only while that block's word is BUSY(g),
and the owner reuses a block only once its word is closed. So a writer that was frozen, or whose
handoff the owner gave up on, finds its blocks closed or reopened for another generation and
writes nothing (its `acquire` fails); one caught mid-write keeps its blocks quarantined
(REVOKED) until it lets go, never reused under it. Without the native module there are no
fences (`available` is False) and writes go unchecked, as before.
"""
from __future__ import annotations

import itertools
import secrets
from typing import Iterator, Sequence

import numpy as np
import torch

try:
    from transfer._memcopy import fence as _fence
except ImportError:   # built without a C compiler
    _fence = None

_OPEN, _ACQUIRE, _RELEASE, _CLOSE, _HELD, _RECLAIM = range(6)
GENERATION_LIMIT = 1 << 61


def available() -> bool:
    return _fence is not None


def generations() -> Iterator[int]:
    """Fresh handoff generations of this process: a random start, so a restarted process's
    numbers are not its previous life's."""
    return itertools.count(secrets.randbelow(GENERATION_LIMIT // 2) + 1)


class Fences:
    """The fence words of one pool (`words`: int64, one per block), local or mapped from a peer."""

    def __init__(self, words: torch.Tensor) -> None:
        self._words = words
        self._address = words.data_ptr()
        self.num_blocks = words.numel()

    def _run(self, block_ids: Sequence[int] | np.ndarray, generation: int, op: int) -> int:
        ids = np.ascontiguousarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"block ids out of range [0, {self.num_blocks})")
        assert _fence is not None
        return int(_fence(self._address, ids, generation, op))

    def open(self, block_ids: Sequence[int], generation: int) -> None:
        """The owner holds `block_ids` for handoff `generation`: its writer may take them."""
        self._run(block_ids, generation, _OPEN)

    def close(self, block_ids: Sequence[int], generation: int) -> int:
        """The handoff ended (done or given up): its writer may no longer take the blocks. Returns
        how many a writer still holds; those are quarantined until `held` says 0. Idempotent."""
        return self._run(block_ids, generation, _CLOSE)

    def held(self, block_ids: Sequence[int], generation: int) -> int:
        """How many of the blocks a writer of `generation` still holds (writing, or quarantined)."""
        return self._run(block_ids, generation, _HELD)

    def reclaim(self, block_ids: Sequence[int], generation: int) -> None:
        """The writer of `generation` died holding the blocks: they are closed now."""
        self._run(block_ids, generation, _RECLAIM)

    def acquire(self, block_ids: Sequence[int] | np.ndarray, generation: int) -> bool:
        """Writer: takes every block for `generation`, or none (False: the handoff is stale)."""
        return bool(self._run(block_ids, generation, _ACQUIRE))

    def release(self, block_ids: Sequence[int] | np.ndarray, generation: int) -> bool:
        """Writer: lets go of the blocks; False when the owner closed the handoff meanwhile (the
        bytes written are not the owner's any more, and it discards them)."""
        return self._run(block_ids, generation, _RELEASE) == 0

    def closed(self) -> bool:
        """Whether every block is closed (no handoff open, nothing quarantined)."""
        return not bool(self._words.any())


def run_blocks(runs: Sequence[tuple[int, int]]) -> np.ndarray:
    """The block ids of (first block, count) runs."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(start, start + count, dtype=np.int64) for start, count in runs])
