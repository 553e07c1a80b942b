"""In-process behaviour of the engine: bad input, layouts, asynchrony, lifecycle."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from tests.helpers import wait_until
from tests.transfer.conftest import LAYOUT, PROCESS_BACKENDS, shm_segments
from tests.transfer.peer_proc import block_bytes
from transfer.region import Region
from transfer.sockio import PUSH_BUFFER_BYTES
from transfer import (BackendUnavailable, CompletionToken, InvalidBlocks, KVLayout, LayoutMismatch,
                      PeerLost, TransferError, available_backends, create_transfer_engine, wire)


@pytest.mark.parametrize("field, value", [("block_size", 32), ("dtype", "float16"),
                                          ("num_layers", 4), ("num_kv_heads", 4), ("head_dim", 64)])
@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_incompatible_layout_is_refused_at_connect(backend: str, field: str, value, make_engine) -> None:
    engine = make_engine(backend)
    other = make_engine(backend, layout=KVLayout(**{**LAYOUT.to_dict(), field: value}))
    with pytest.raises(LayoutMismatch, match=field):
        engine.connect(other.descriptor())
    # A different number of blocks is fine: blocks are what must match.
    bigger = make_engine(backend, layout=KVLayout(**{**LAYOUT.to_dict(), "num_blocks": 200}))
    peer = engine.connect(json.loads(json.dumps(bigger.descriptor())))
    engine.queue_transfer_with_token(peer, [95], [199]).wait(10)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_vllm_cpu_order_moves_whole_blocks_of_every_layer(backend: str, make_engine) -> None:
    layout = KVLayout(**{**LAYOUT.to_dict(), "order": "LBHKTD"})
    src, dst = make_engine(backend, layout=layout, seed=1), make_engine(backend, layout=layout, seed=2)
    src_pool, dst_pool = src._region.tensor, dst._region.tensor
    before = dst_pool.clone()
    peer = src.connect(dst.descriptor())
    src.queue_transfer_with_token(peer, [4, 5, 90], [10, 11, 3]).wait(10)
    def raw(pool: torch.Tensor, ids: list[int]) -> bytes:
        # Block b of this order is pool[:, b]: every layer's keys and values of that block.
        return pool[:, ids].contiguous().view(torch.uint8).numpy().tobytes()

    assert raw(dst_pool, [10, 11, 3]) == raw(src_pool, [4, 5, 90])
    untouched = [b for b in range(layout.num_blocks) if b not in (10, 11, 3)]
    assert raw(dst_pool, untouched) == raw(before, untouched)


BAD_IDS = [([96], [0]), ([0], [96]), ([-1], [0]), ([0, 1], [2]), ([0, 1], [2, 2]), ([0.5], [1]),
           ([True], [1]), ("ab", [1, 2])]


@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_bad_block_ids_end_the_token(backend: str, make_engine) -> None:
    engine, other = make_engine(backend, seed=1), make_engine(backend)
    peer = engine.connect(other.descriptor())
    for src, dst in BAD_IDS:
        token = engine.queue_transfer_with_token(peer, src, dst)
        assert token.is_done() and isinstance(token.error, InvalidBlocks), (src, dst)
        with pytest.raises(InvalidBlocks):
            token.wait(1)
    empty = engine.queue_transfer_with_token(peer, [], [])
    assert empty.is_done() and empty.error is None
    engine.queue_transfer_with_token(peer, [3, 4], [5, 6]).wait(10)
    assert block_bytes(other._region.tensor, [5, 6]) == block_bytes(engine._region.tensor, [3, 4])


def test_tcp_peer_checks_block_ranges_itself(make_engine) -> None:
    """A descriptor that overstates the peer's pool gets past our checks, not the peer's."""
    engine, other = make_engine("tcp", seed=2), make_engine("tcp")
    lying = other.descriptor()
    lying["layout"] = {**lying["layout"], "num_blocks": 1000}
    peer = engine.connect(lying)
    with pytest.raises(InvalidBlocks, match="peer"):
        engine.queue_transfer_with_token(peer, [0, 1], [500, 501]).wait(10)
    # The rejected payload was drained: the same connection carries the next transfer.
    engine.queue_transfer_with_token(peer, [7], [8]).wait(10)
    assert block_bytes(other._region.tensor, [8]) == block_bytes(engine._region.tensor, [7])


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_caller_thread_is_free_while_a_large_transfer_runs(backend: str, make_engine) -> None:
    big = KVLayout(num_layers=4, num_blocks=256, block_size=16, num_kv_heads=8, head_dim=64, dtype="float32")
    engine, other = make_engine(backend, layout=big, seed=3), make_engine(backend, layout=big)
    peer = engine.connect(other.descriptor())
    ids = list(range(big.num_blocks))
    token = engine.queue_transfer_with_token(peer, ids, ids[::-1])  # 64 MiB in 256 single-block runs
    counter = 0
    while not token.is_done():
        counter += 1
    token.wait(0)
    assert counter > 1000  # the loop kept running: queueing returned before the copy ended
    assert block_bytes(other._region.tensor, ids[::-1]) == block_bytes(engine._region.tensor, ids)


def test_auto_uses_shm_on_the_same_host_and_tcp_for_tcp_only_peers(make_engine) -> None:
    engine = make_engine("auto", seed=4)
    same_host, tcp_only = make_engine("auto"), make_engine("tcp")
    assert engine.peer_backend(engine.connect(same_host.descriptor())) == "shm"
    tcp_peer = engine.connect(tcp_only.descriptor())
    assert engine.peer_backend(tcp_peer) == "tcp"
    engine.queue_transfer_with_token(tcp_peer, [1], [2]).wait(10)
    foreign = {**same_host.descriptor(), "host_id": "elsewhere/boot", "transfer_id": "x-1"}
    assert engine.peer_backend(engine.connect(foreign)) == "tcp"


def test_a_pool_is_registered_once_and_must_fit_its_layout(make_engine) -> None:
    engine = create_transfer_engine("tcp")
    try:
        pool = engine.allocate_region(LAYOUT)
        other = make_engine("tcp", seed=5)
        peer = other.connect(engine.descriptor())
        other.queue_transfer_with_token(peer, [9], [4]).wait(10)
        assert block_bytes(pool, [4]) == block_bytes(other._region.tensor, [9])
        with pytest.raises(TransferError, match="already registered"):
            engine.allocate_region(LAYOUT)
        engine.unregister_region()
        with pytest.raises(LayoutMismatch):
            Region(LAYOUT, pool[:1])
        with pytest.raises(LayoutMismatch):
            Region(LAYOUT, pool.float())
    finally:
        engine.close()


def test_close_is_idempotent_and_frees_everything() -> None:
    engine, other = create_transfer_engine("auto"), create_transfer_engine("auto")
    engine.allocate_region(LAYOUT)
    other.allocate_region(LAYOUT)
    peer = engine.connect(other.descriptor())
    engine.queue_transfer_with_token(peer, [1], [1]).wait(10)
    assert len(shm_segments()) >= 2
    for _ in range(2):
        engine.close()
        other.close()
    assert not any(e.transfer_id in name for e in (engine, other) for name in shm_segments())
    with pytest.raises(PeerLost):
        engine.queue_transfer_with_token(peer, [1], [1]).wait(1)
    with pytest.raises(TransferError, match="closed"):
        engine.allocate_region(LAYOUT)


def test_disconnected_peer_fails_new_transfers(make_engine) -> None:
    engine, other = make_engine("shm"), make_engine("shm")
    peer = engine.connect(other.descriptor())
    engine.disconnect(peer)
    with pytest.raises(PeerLost):
        engine.queue_transfer_with_token(peer, [1], [1]).wait(1)


def test_backend_selection() -> None:
    assert {"auto", "shm", "tcp"} <= set(available_backends())
    with pytest.raises(ValueError, match="unknown transfer backend"):
        create_transfer_engine("rdma")
    if "neuron" not in available_backends():
        with pytest.raises(BackendUnavailable, match="torch-neuronx"):
            create_transfer_engine("neuron")


def test_a_token_serves_one_transfer(make_engine) -> None:
    engine, other = make_engine("shm"), make_engine("shm")
    peer = engine.connect(other.descriptor())
    token = CompletionToken()
    assert engine.queue_transfer_with_token(peer, [1], [1], token) is token
    token.wait(10)
    with pytest.raises(ValueError, match="one transfer"):
        engine.queue_transfer_with_token(peer, [1], [1], token)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_done_callbacks_run_once_when_a_transfer_ends(backend: str, make_engine) -> None:
    engine, other = make_engine(backend, seed=7), make_engine(backend)
    peer = engine.connect(other.descriptor())
    token, calls = CompletionToken(), []
    token.add_done_callback(lambda t: 1 / 0)   # a failing callback neither stops the others nor the transfer
    token.add_done_callback(calls.append)
    engine.queue_transfer_with_token(peer, [1, 2], [3, 4], token).wait(10)
    wait_until(lambda: calls, timeout=10, what="the callback")   # it runs on the transfer thread, just after
    assert calls == [token]
    token.add_done_callback(calls.append)      # already done: called at once
    assert calls == [token, token]
    failed, errors = CompletionToken(), []
    failed.add_done_callback(lambda t: errors.append(t.error))
    engine.queue_transfer_with_token(peer, [1], [LAYOUT.num_blocks], failed)
    assert len(errors) == 1 and isinstance(errors[0], InvalidBlocks)


def test_tcp_sockets_get_buffers_for_whole_pushes_where_the_host_allows(make_engine) -> None:
    engine, other = make_engine("tcp", seed=8), make_engine("tcp")
    peer = engine.connect(other.descriptor())
    engine.queue_transfer_with_token(peer, [1], [1]).wait(10)
    link = engine._peer(peer)._link._sock
    allowed = [int(Path(f"/proc/sys/net/core/{kind}mem_max").read_text()) >= PUSH_BUFFER_BYTES for kind in "wr"]
    for option, ok in zip((socket.SO_SNDBUF, socket.SO_RCVBUF), allowed):
        assert (link.getsockopt(socket.SOL_SOCKET, option) >= PUSH_BUFFER_BYTES) is ok
    assert link.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_tcp_listener_serves_only_its_engine_and_survives_garbage(make_engine) -> None:
    engine, other = make_engine("tcp", seed=6), make_engine("tcp")
    impostor = {**other.descriptor(), "transfer_id": "restarted-1"}
    with pytest.raises(PeerLost, match="serves engine"):
        engine.queue_transfer_with_token(engine.connect(impostor), [1], [1]).wait(10)
    info = other.descriptor()["transports"]["tcp"]
    with socket.create_connection((info["host"], info["port"]), timeout=5) as junk:
        junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
        try:  # after its challenge, the listener hangs up on a stream that is not ours (unread bytes: a reset)
            assert junk.recv(wire.CHALLENGE_BYTES, socket.MSG_WAITALL)[:4] == wire.MAGIC
            assert junk.recv(1) == b""
        except ConnectionResetError:
            pass
    peer = engine.connect(other.descriptor())
    engine.queue_transfer_with_token(peer, [2], [3]).wait(10)
    assert block_bytes(other._region.tensor, [3]) == block_bytes(engine._region.tensor, [2])
