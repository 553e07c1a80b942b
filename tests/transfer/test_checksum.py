"""The checksum of a push: the one the push computes over the bytes it sends equals the
receiver's over its destination blocks, over shm (in the copy's pass) and tcp, in both pool
orders; it is CRC-32C, and it sees a single flipped bit."""
from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch

from tests.transfer.conftest import LAYOUT
from transfer import InvalidBlocks, KVLayout, RegionNotRegistered, create_transfer_engine, memcopy


@pytest.mark.parametrize("order", ["LKBTHD", "LBHKTD"])
@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_source_and_destination_checksums_agree_after_a_push(backend: str, order: str, make_engine) -> None:
    layout = KVLayout(**{**LAYOUT.to_dict(), "order": order})
    src, dst = make_engine(backend, layout=layout, seed=1), make_engine(backend, layout=layout, seed=2)
    src_ids, dst_ids = [4, 5, 90, 7], [10, 11, 3, 60]    # out of order, some adjacent on both sides
    sent = src.checksum(src_ids, dst_ids)
    assert dst.checksum(dst_ids) != sent
    token = src.queue_transfer_with_token(src.connect(dst.descriptor()), src_ids, dst_ids, checksum=True)
    token.wait(10)
    assert dst.checksum(dst_ids) == sent == token.checksum
    # Listing the same pairs in another order names the same bytes.
    assert dst.checksum([60, 3, 11, 10]) == sent == src.checksum([7, 90, 5, 4], [60, 3, 11, 10])


def test_the_checksum_is_crc32c_of_the_bytes_plane_by_plane_in_destination_order(make_engine) -> None:
    engine = make_engine("shm", seed=3)
    pool = engine._region.tensor          # (layers, k/v, blocks, ...) in our order
    expected = b"".join(pool[layer, kv, [9, 2]].contiguous().view(torch.uint8).numpy().tobytes()
                        for layer in range(LAYOUT.num_layers) for kv in range(2))
    assert engine.checksum([2, 9], [1, 0]) == crc32c.crc32c(expected)
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


def test_an_unsummed_push_reports_no_checksum_and_an_empty_one_zero(make_engine) -> None:
    src, dst = make_engine("shm", seed=5), make_engine("shm", seed=6)
    peer = src.connect(dst.descriptor())
    plain = src.queue_transfer_with_token(peer, [1], [2])
    plain.wait(10)
    assert plain.checksum is None
    empty = src.queue_transfer_with_token(peer, [], [], checksum=True)
    empty.wait(10)
    assert empty.checksum == 0 == crc32c.crc32c(b"")


@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])
@pytest.mark.parametrize("lengths", [[0], [1, 7, 8, 9], [767, 768, 769], [16384, 16387, 100_000]])
def test_the_copy_loops_agree_with_the_crc32c_package(lengths: list[int], native: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every length class of the native loop (tail bytes, one chain, three joined chains), the
    copy it fuses with, and the fallback without a C compiler, against the reference package,
    each range chained onto the last."""
    if native and not memcopy.NATIVE:
        pytest.skip("built without a C compiler")
    if not native:
        monkeypatch.setattr(memcopy, "_native_crc32c_ranges", None)
        monkeypatch.setattr(memcopy, "_native_copy_crc32c", None)
    rng = np.random.default_rng(len(lengths))
    src = rng.integers(0, 256, sum(lengths) + 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    offsets = np.cumsum([3] + lengths[:-1]).astype(np.int64)
    want = 7
    for offset, length in zip(offsets.tolist(), lengths):
        want = crc32c.crc32c(src[offset:offset + length].tobytes(), want)
    sizes = np.array(lengths, dtype=np.int64)
    assert memcopy.crc32c_ranges(src.ctypes.data, offsets, sizes, 7) == want
    assert memcopy.copy_ranges_crc32c(dst.ctypes.data, src.ctypes.data, offsets + 1, offsets, sizes, 7) == want
    assert np.array_equal(dst[offsets[0] + 1:offsets[-1] + 1 + lengths[-1]], src[offsets[0]:offsets[-1] + lengths[-1]])


def _python_crc32c_prefixes(data: bytes, crc: int) -> list[int]:
    """CRC-32C of every prefix of `data` (chained onto `crc`), bit by bit from the polynomial."""
    state, out = crc ^ 0xFFFFFFFF, [crc]
    for byte in data:
        state ^= byte
        for _ in range(8):
            state = (state >> 1) ^ (0x82F63B78 if state & 1 else 0)
        out.append(state ^ 0xFFFFFFFF)
    return out


@pytest.mark.parametrize("path", memcopy.CRC32C_PATHS)
def test_every_crc32c_path_agrees_on_every_length_and_alignment(path: str) -> None:
    """Each way the native loop computes CRC-32C (folding, crc32 chains, table), alone and fused
    with the copy, on every length up to 4 KiB and a few MiB, from and to unaligned addresses,
    against a bitwise CRC-32C and the reference package."""
    if not memcopy.NATIVE:
        pytest.skip("built without a C compiler")
    before = memcopy.crc32c_path()
    try:
        memcopy.crc32c_path(path)
    except ValueError:
        pytest.skip(f"this CPU has no {path} CRC-32C")
    try:
        rng = np.random.default_rng(7)
        src = rng.integers(0, 256, (3 << 20) + 4200, dtype=np.uint8)
        dst = np.zeros_like(src)
        cases = list(enumerate(_python_crc32c_prefixes(src[5:4101].tobytes(), 99)))
        cases += [(n, crc32c.crc32c(src[5:5 + n].tobytes(), 99)) for n in ((1 << 20) + 255, 3 << 20)]
        for length, want in cases:
            src_at, dst_at, size = np.array([5]), np.array([length % 61 + 1]), np.array([length])
            assert memcopy.crc32c_ranges(src.ctypes.data, src_at, size, 99) == want, length
            assert memcopy.copy_ranges_crc32c(dst.ctypes.data, src.ctypes.data, dst_at, src_at, size, 99) == want
            assert np.array_equal(dst[dst_at[0]:dst_at[0] + length], src[5:5 + length]), length
    finally:
        memcopy.crc32c_path(before)


@pytest.mark.slow
def test_a_range_over_1_5_gib_sums_right_on_every_path() -> None:
    """The crc32 chains join three segments of over 512 MiB each here (x^(8n) past 2^32 bits)."""
    if not memcopy.NATIVE:
        pytest.skip("built without a C compiler")
    data = np.tile(np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8), 1600)
    want, before = crc32c.crc32c(data), memcopy.crc32c_path()
    try:
        for path in memcopy.CRC32C_PATHS[1:]:
            try:
                memcopy.crc32c_path(path)
            except ValueError:
                continue
            assert memcopy.crc32c_ranges(data.ctypes.data, np.array([0]), np.array([data.size])) == want, path
    finally:
        memcopy.crc32c_path(before)
