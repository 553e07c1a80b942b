"""Pure logic: run planning, byte ranges, wire frames and the token state machine."""
from __future__ import annotations

import time

import pytest

from transfer import (CompletionToken, InvalidBlocks, KVLayout, LayoutMismatch, PeerLost, Run, TransferTimeout,
                      plan_runs)
from transfer import wire
from transfer.blocks import byte_ranges
from transfer.errors import RegionNotRegistered


def test_adjacent_pairs_merge_into_runs() -> None:
    runs = plan_runs([7, 3, 4, 5, 9, 10], [20, 0, 1, 2, 30, 40], 16, 64)
    assert runs == [Run(3, 0, 3), Run(7, 20, 1), Run(9, 30, 1), Run(10, 40, 1)]
    by_peer = plan_runs([1, 2, 3, 8], [50, 51, 52, 4], 16, 64)
    assert by_peer == [Run(8, 4, 1), Run(1, 50, 3)]


@pytest.mark.parametrize("local, remote", [([16], [0]), ([0], [64]), ([1, 1], [2, 3]), ([1], [])])
def test_bad_pairs_are_refused(local, remote) -> None:
    with pytest.raises(InvalidBlocks):
        plan_runs(local, remote, 16, 64)


def test_byte_ranges_walk_runs_then_planes() -> None:
    layout = KVLayout(num_layers=2, num_blocks=10, block_size=2, num_kv_heads=1, head_dim=4, dtype="float32")
    chunk = layout.chunk_bytes  # 32
    assert byte_ranges(layout, [3, 9], [2, 1]).pairs() == [
        (3 * chunk, 2 * chunk), (9 * chunk, chunk), (13 * chunk, 2 * chunk), (19 * chunk, chunk),
        (23 * chunk, 2 * chunk), (29 * chunk, chunk), (33 * chunk, 2 * chunk), (39 * chunk, chunk)]


def test_vllm_cpu_order_has_one_plane_per_layer() -> None:
    layout = KVLayout(num_layers=2, num_blocks=10, block_size=2, num_kv_heads=1, head_dim=4, order="LBHKTD")
    assert layout.shape == (2, 10, 1, 2, 2, 4) and layout.num_planes == 2
    chunk = layout.plane_chunk_bytes  # keys and values of a block in one layer: 64
    assert chunk == 2 * layout.chunk_bytes == 64
    assert byte_ranges(layout, [3, 9], [2, 1]).pairs() == [
        (3 * chunk, 2 * chunk), (9 * chunk, chunk), (13 * chunk, 2 * chunk), (19 * chunk, chunk)]


def test_layouts_of_different_orders_are_refused_with_both_named() -> None:
    ours = KVLayout(num_layers=2, num_blocks=10, block_size=2, num_kv_heads=1, head_dim=4)
    vllm = KVLayout(num_layers=2, num_blocks=10, block_size=2, num_kv_heads=1, head_dim=4, order="LBHKTD")
    with pytest.raises(LayoutMismatch, match=r"ours \[LKBTHD .*peer's \[LBHKTD .*order: LKBTHD != LBHKTD"):
        ours.check_compatible(vllm)
    with pytest.raises(ValueError, match="unsupported KV order"):
        KVLayout(num_layers=2, num_blocks=10, block_size=2, num_kv_heads=1, head_dim=4, order="BLKHTD")
    # A peer that predates `order` lays its pool out in ours.
    legacy = {k: v for k, v in ours.to_dict().items() if k != "order"}
    assert KVLayout.from_dict(legacy) == ours


def test_request_and_reply_round_trip() -> None:
    data = wire.encode_request(wire.Request(wire.OP_WRITE, 42, [(5, 3), (1 << 40, 1)], 4096))
    op, tid, count, payload = wire.decode_request_head(data[:wire.REQUEST_BYTES])
    assert (op, tid, count, payload) == (wire.OP_WRITE, 42, 2, 4096)
    assert wire.decode_ranges(data[wire.REQUEST_BYTES:]) == [(5, 3), (1 << 40, 1)]

    reply = wire.encode_reply(wire.OP_WRITE, 42, RegionNotRegistered("gone"))
    head, msg_len = wire.decode_reply_head(reply[:wire.REPLY_BYTES])
    assert reply[wire.REPLY_BYTES:] == b"gone" and msg_len == 4
    with pytest.raises(RegionNotRegistered, match="gone"):
        wire.Reply(head.op, head.transfer_id, head.status, "gone").raise_for_status()


def test_garbage_is_not_a_frame() -> None:
    with pytest.raises(PeerLost):
        wire.decode_request_head(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[:wire.REQUEST_BYTES])
    with pytest.raises(PeerLost):
        huge_hello = wire.MAGIC + bytes([wire.OP_HELLO]) + bytes(12) + (1 << 20).to_bytes(8, "big")
        wire.decode_request_head(huge_hello)


def test_token_expires_only_while_queued() -> None:
    queued, running = CompletionToken(), CompletionToken()
    for token in (queued, running):
        token._arm(time.monotonic() + 0.05)
    assert running._start()
    with pytest.raises(TransferTimeout):
        queued.wait(5)
    assert not queued._start()  # an expired token is never run
    assert not running.is_done()  # a running transfer enforces its own deadline
    with pytest.raises(TransferTimeout, match="waiting"):
        running.wait(0.05)
    running._finish(None)
    running.wait(0)
    assert running.error is None
