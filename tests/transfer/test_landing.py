"""Landing marks: a fenced push raises its handoff's mark to every byte it wrote (shm copy loop,
tcp receive), a stale one moves none, and the receiver's sum followed at any marks equals the
checksum of the whole blocks."""
from __future__ import annotations

import random

import numpy as np
import pytest

from transfer import StaleHandoff
from transfer.blocks import Ranges
from transfer.landing import byte_slice

SRC, DST = [4, 5, 90, 7], [10, 11, 3, 60]    # out of order, some adjacent on both sides


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_a_fenced_push_marks_every_byte_and_the_followed_sum_matches(backend: str, make_engine) -> None:
    src, dst = make_engine(backend, seed=1), make_engine(backend, seed=2)
    dst.fences.open(DST, 7)
    landed = dst.follow_landing(DST)
    assert not landed.advance()   # nothing landed yet
    token = src.queue_transfer_with_token(src.connect(dst.descriptor()), SRC, DST, checksum=True, generation=7)
    token.wait(10)
    assert dst._region.marks.landed(min(DST)) == landed.total > 0
    assert landed.advance() and landed.summed == landed.total
    assert landed.finish() == token.checksum == dst.checksum(DST)
    assert dst.fences.close(DST, 7) == 0


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_a_stale_push_moves_no_mark(backend: str, make_engine) -> None:
    src, dst = make_engine(backend, seed=1), make_engine(backend, seed=2)
    dst.fences.open(DST, 7)
    landed = dst.follow_landing(DST)
    token = src.queue_transfer_with_token(src.connect(dst.descriptor()), SRC, DST, checksum=True, generation=8)
    with pytest.raises(StaleHandoff):
        token.wait(10)
    assert dst._region.marks.landed(min(DST)) == 0 and not landed.advance()


def test_the_sum_followed_at_any_marks_equals_the_whole_blocks_sum(make_engine) -> None:
    engine, ids, rng = make_engine("shm", seed=5), [9, 2, 3, 40, 41], random.Random(0)
    marks, whole = engine._region.marks, engine.checksum(ids)
    marks.publish(2, 1 << 40)   # a mark left by an earlier handoff: following starts from zero
    for _ in range(20):
        landed = engine.follow_landing(ids)
        assert not landed.advance()
        for point in sorted(rng.sample(range(1, landed.total), 4)) + [landed.total + 99]:
            marks.publish(2, point)
            landed.advance()
            assert landed.summed == min(point, landed.total)
        assert landed.finish() == whole
    assert engine.follow_landing(ids).finish() == whole   # nothing marked: summed whole at the end


def test_byte_slice_cuts_any_stretch_of_the_stream() -> None:
    ranges = Ranges(np.array([100, 0, 50], dtype=np.int64), np.array([10, 5, 20], dtype=np.int64))
    stream = [o + i for o, n in zip(ranges.offsets.tolist(), ranges.lengths.tolist()) for i in range(n)]
    ends = np.cumsum(ranges.lengths)
    for start in range(len(stream)):
        for stop in range(start + 1, len(stream) + 1):
            offsets, lengths = byte_slice(ranges, ends, start, stop)
            got = [o + i for o, n in zip(offsets.tolist(), lengths.tolist()) for i in range(n)]
            assert got == stream[start:stop]
