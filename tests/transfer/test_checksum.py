"""The checksum of a push: the sender's over its source blocks equals the receiver's over its
destination blocks, in both pool orders, and it sees a single flipped bit."""
from __future__ import annotations

import zlib

import pytest
import torch

from tests.transfer.conftest import LAYOUT
from transfer import InvalidBlocks, KVLayout, RegionNotRegistered, create_transfer_engine


@pytest.mark.parametrize("order", ["LKBTHD", "LBHKTD"])
def test_source_and_destination_checksums_agree_after_a_push(order: str, make_engine) -> None:
    layout = KVLayout(**{**LAYOUT.to_dict(), "order": order})
    src, dst = make_engine("shm", layout=layout, seed=1), make_engine("shm", layout=layout, seed=2)
    src_ids, dst_ids = [4, 5, 90, 7], [10, 11, 3, 60]    # out of order, some adjacent on both sides
    sent = src.checksum(src_ids, dst_ids)
    assert dst.checksum(dst_ids) != sent
    src.queue_transfer_with_token(src.connect(dst.descriptor()), src_ids, dst_ids).wait(10)
    assert dst.checksum(dst_ids) == sent
    # Listing the same pairs in another order names the same bytes.
    assert dst.checksum([60, 3, 11, 10]) == sent == src.checksum([7, 90, 5, 4], [60, 3, 11, 10])


def test_the_checksum_is_crc32_of_the_bytes_plane_by_plane_in_destination_order(make_engine) -> None:
    engine = make_engine("shm", seed=3)
    pool = engine._region.tensor          # (layers, k/v, blocks, ...) in our order
    expected = b"".join(pool[layer, kv, [9, 2]].contiguous().view(torch.uint8).numpy().tobytes()
                        for layer in range(LAYOUT.num_layers) for kv in range(2))
    assert engine.checksum([2, 9], [1, 0]) == zlib.crc32(expected)
    assert engine.checksum([]) == 0


def test_one_flipped_bit_changes_the_checksum(make_engine) -> None:
    engine = make_engine("shm", seed=4)
    before = engine.checksum([0, 1, 2])
    flat = engine._region.flat
    offset = 2 * LAYOUT.plane_chunk_bytes + 5     # block 2 of the first plane
    flat[offset] ^= 0x10
    assert engine.checksum([0, 1, 2]) != before
    flat[offset] ^= 0x10
    assert engine.checksum([0, 1, 2]) == before


def test_bad_ids_and_no_pool_are_clear_errors(make_engine) -> None:
    engine = make_engine("shm")
    for ids in ([LAYOUT.num_blocks], [-1], [1, 1], [True]):
        with pytest.raises(InvalidBlocks):
            engine.checksum(ids)
    with pytest.raises(InvalidBlocks, match="1 source ids but 2"):
        engine.checksum([1], [1, 2])
    bare = create_transfer_engine("tcp")
    try:
        with pytest.raises(RegionNotRegistered):
            bare.checksum([0])
    finally:
        bare.close()
