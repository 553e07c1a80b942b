"""Landing marks: how far a push into a handoff's blocks has got, so that the receiver checks
the bytes that are in place while the rest are still being written.

A push lays its bytes down as one stream, in the order its checksum covers them
(transfer.checksum). One int64 word per block sits next to the fence words (in the shared
segment when the pool is shared); the word of a handoff's first destination block counts the
bytes of that stream in place. The receiver zeroes it when it opens the blocks for the
handoff (`follow`, right after transfer.fences' `open`); the writer, which may write only
while it holds the blocks for that handoff, raises it as it goes (the shm copy loop every
256 KiB, the tcp listener after every receive call), each raise ordered after the bytes it
counts. A stale writer cannot take the blocks, so it never moves a mark.

`LandedSum` is the receiver's CRC-32C of its blocks summed part by part as they land, so a
checked pull costs about the longer of the copy and the sum, not both.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from transfer.blocks import Ranges
from transfer.memcopy import crc32c_ranges, mark_word

if TYPE_CHECKING:   # the region module builds marks from this one
    from transfer.region import Region

# How long a receiver following a push sleeps when nothing new has landed: the lag of its
# check behind the writer, and about 5000 cheap wake-ups a second while it follows one.
FOLLOW_POLL_S = 0.0002


class LandingMarks:
    """The landing marks of one pool (`words`: int64, one per block), local or mapped from a peer."""

    def __init__(self, words: torch.Tensor) -> None:
        self._words = words
        self._address = words.data_ptr()
        self.num_blocks = words.numel()

    def address(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} out of range [0, {self.num_blocks})")
        return self._address + 8 * block

    def publish(self, block: int, nbytes: int) -> None:
        """Writer: `nbytes` of the handoff starting at `block` are in place (after every store so far)."""
        mark_word(self.address(block), nbytes)

    def landed(self, block: int) -> int:
        """Receiver: bytes in place of the handoff whose first block is `block`."""
        return mark_word(self.address(block))


class LandedSum:
    """The CRC-32C of our blocks `block_ids` as a push lays them down, summed as they land.

    Create it right after the blocks are opened for the handoff and before its writer may
    start: it zeroes the handoff's mark. `advance` sums what landed since the last call;
    `finish`, once the push is known to be complete, sums the rest and returns the checksum
    (equal to transfer.checksum's over the same blocks). One thread at a time.
    """

    def __init__(self, region: Region, marks: LandingMarks | None, ranges: Ranges, first_block: int) -> None:
        self._region = region   # keeps the pool mapped while it is read
        self._base = region.address
        self._marks = marks
        self._ranges = ranges
        self._ends = np.cumsum(ranges.lengths)
        self.total = int(self._ends[-1]) if len(ranges) else 0
        self._first = first_block
        self.summed = 0
        self._crc = 0
        if marks is not None:
            marks.publish(first_block, 0)

    def advance(self) -> bool:
        """Sums the bytes landed since the last call; False when none had."""
        if self._marks is None:
            return False
        landed = min(self._marks.landed(self._first), self.total)
        if landed <= self.summed:
            return False
        self._sum(landed)
        return True

    def finish(self) -> int:
        """The checksum of every byte: call once the push completed."""
        if self.summed < self.total:
            self._sum(self.total)
        return self._crc

    def _sum(self, stop: int) -> None:
        offsets, lengths = byte_slice(self._ranges, self._ends, self.summed, stop)
        self._crc = crc32c_ranges(self._base, offsets, lengths, self._crc)
        self.summed = stop


def byte_slice(ranges: Ranges, ends: np.ndarray, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of the bytes [start, stop) of `ranges` taken as one stream
    (`ends`: the cumulative lengths); 0 <= start < stop <= the total."""
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(ends, stop, side="left"))
    offsets = ranges.offsets[first:last + 1].copy()
    lengths = ranges.lengths[first:last + 1].copy()
    head = start - (int(ends[first]) - int(ranges.lengths[first]))
    offsets[0] += head
    lengths[0] -= head
    lengths[-1] -= int(ends[last]) - stop
    return offsets, lengths
