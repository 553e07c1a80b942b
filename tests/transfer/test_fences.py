"""Handoff fences: the word per block, and fenced writes over shm and tcp landing only in blocks open
for their generation (the receiver here is an engine of this process, the writer another engine)."""
from __future__ import annotations

import pytest
import torch

from tests.transfer.conftest import LAYOUT
from tests.transfer.peer_proc import block_bytes
from transfer import StaleHandoff, wire
from transfer.fences import Fences, generations, run_blocks


def test_a_writer_takes_blocks_only_while_they_are_open_for_its_generation() -> None:
    fences = Fences(torch.zeros(8, dtype=torch.int64))
    assert not fences.acquire([1, 2], 5)                   # never opened
    fences.open([1, 2], 5)
    assert not fences.acquire([1, 2], 6)                   # another handoff's
    assert not fences.acquire([1, 2, 3], 5) and fences.held([1, 2], 5) == 0   # all or none
    assert fences.acquire([1, 2], 5) and fences.held([1, 2], 5) == 2
    assert not fences.acquire([2], 5)                      # one writer at a time
    assert fences.release([1, 2], 5) and fences.close([1, 2], 5) == 0 and fences.closed()
    assert not fences.acquire([1, 2], 5)                   # closed: a late writer writes nothing


def test_closing_under_a_writer_quarantines_the_blocks_until_it_lets_go() -> None:
    fences = Fences(torch.zeros(8, dtype=torch.int64))
    fences.open([3, 4], 7)
    assert fences.acquire([3, 4], 7)
    assert fences.close([3, 4], 7) == 2 and fences.close([3, 4], 7) == 2   # idempotent, still held
    assert not fences.release([3, 4], 7)                   # the writer learns it was given up
    assert fences.held([3, 4], 7) == 0 and fences.closed()
    fences.open([5], 8)
    assert fences.acquire([5], 8) and fences.close([5], 8) == 1
    fences.reclaim([5], 8)                                 # its writer died holding it
    assert fences.closed()


def test_generations_are_fresh_and_in_range() -> None:
    first, second = generations(), generations()
    a, b = next(first), next(first)
    assert b == a + 1 and 0 < a < 2**61 and next(second) != a


def test_a_fenced_write_header_round_trips() -> None:
    head = wire.encode_request(wire.Request(wire.OP_FENCED_WRITE, 9, [(4, 2)], 128, generation=77))
    op, tid, count, payload = wire.decode_request_head(head[:wire.REQUEST_BYTES])
    body = head[wire.REQUEST_BYTES:]
    assert (op, tid, count, payload) == (wire.OP_FENCED_WRITE, 9, 1, 128)
    assert wire.decode_ranges(body[:16]) == [(4, 2)] and wire.decode_generation(body[16:]) == 77
    assert run_blocks([(4, 2), (9, 1)]).tolist() == [4, 5, 9]


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_a_write_lands_only_under_the_receivers_current_generation(backend: str, make_engine) -> None:
    src, dst = make_engine(backend, seed=1), make_engine(backend)
    pool = dst._region.tensor
    peer = src.connect(dst.descriptor())
    fences = dst.fences
    assert fences is not None
    fences.open([5, 6], 40)
    src.queue_transfer_with_token(peer, [1, 2], [5, 6], generation=40, checksum=True).wait(10)
    assert block_bytes(pool, [5, 6]) == block_bytes(src._region.tensor, [1, 2])
    assert fences.close([5, 6], 40) == 0
    fences.open([5, 6], 41)                                # the blocks reused for another handoff
    before = block_bytes(pool, list(range(LAYOUT.num_blocks)))
    for stale in (40, 39):
        with pytest.raises(StaleHandoff):
            src.queue_transfer_with_token(peer, [3, 4], [5, 6], generation=stale).wait(10)
    assert block_bytes(pool, list(range(LAYOUT.num_blocks))) == before   # not a byte landed
    src.queue_transfer_with_token(peer, [3, 4], [5, 6], generation=41).wait(10)   # the link still serves
    assert block_bytes(pool, [5, 6]) == block_bytes(src._region.tensor, [3, 4])
    fences.close([5, 6], 41)
    assert fences.closed()
