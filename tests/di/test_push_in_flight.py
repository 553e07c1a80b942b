"""A prefill worker keeps serving while one of its tcp pushes is held up by a slow decode peer.

The prefill worker is a real process; the decode side is a RecvBuffer in the test process whose
tcp listener holds every incoming push at a gate the test opens, so the push of the first
request stays in flight for as long as the test wants, whatever the machine's speed.
"""
from __future__ import annotations

import socket
import threading
import uuid
from typing import Any, Iterator

import httpx
import pytest

from neuron_connector import PullState, RecvBuffer
from tests.di.workers import prefill_body
from tests.helpers import wait_until
from tests.neuron_connector.kv import wait_terminal
from tests.worker_process import WorkerProcess
from transfer import KVLayout, TransferEngine
from transfer.engine import new_transfer_id
from transfer.tcp import TcpBackend
from worker.model.loader import builtin_model_path, load_config

NUM_BLOCKS = 256
BLOCK_SIZE = 16     # the worker's default
GATE_TIMEOUT_S = 120.0


class GatedTcpBackend(TcpBackend):
    """A tcp listener that holds each push, unread, until `gate` opens; `arrived` is set when one
    comes in. The sender's push cannot end meanwhile: its reply only follows the last byte read."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1", transfer_id=new_transfer_id())
        self.arrived = threading.Event()
        self.gate = threading.Event()

    def _serve_write(self, conn: socket.socket, tid: int, ranges: list[tuple[int, int]],
                     payload: int, deadline: float, generation: int | None = None) -> None:
        self.arrived.set()
        self.gate.wait(GATE_TIMEOUT_S)
        super()._serve_write(conn, tid, ranges, payload, deadline, generation)


def builtin_layout() -> KVLayout:
    mc = load_config(builtin_model_path())
    return KVLayout(mc.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, mc.num_key_value_heads, mc.head_dim)


@pytest.fixture
def gated_decode() -> Iterator[tuple[RecvBuffer, GatedTcpBackend]]:
    backend = GatedTcpBackend()
    engine = TransferEngine([backend], shm_pool=False, transfer_id=backend._transfer_id)
    layout = builtin_layout()
    engine.allocate_region(layout)
    recv = RecvBuffer(engine, layout, engine_id=f"gated-decode-{uuid.uuid4().hex[:6]}", default_timeout=90.0)
    recv.start()
    try:
        yield recv, backend
    finally:
        backend.gate.set()
        recv.close()
        engine.close()


def prefill_leg(prefill: WorkerProcess, uid: str, prompt: list[int]) -> None:
    """The prefill leg of `uid` as the proxy sends it; returns once its first token is back."""
    body: dict[str, Any] = {"model": "neuron-di-builtin", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                            "ignore_eos": True}
    reply = httpx.post(f"{prefill.url}/v1/completions", json=prefill_body(body, uid),
                       headers={"X-Request-Id": uid}, timeout=60.0)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 1


def test_the_prefill_engine_steps_while_a_tcp_push_is_held(gated_decode: tuple[RecvBuffer, GatedTcpBackend]) -> None:
    recv, backend = gated_decode
    prefill = WorkerProcess("prefill", "tcp")
    try:
        # 1000 tokens: 63 blocks, a push of several MB.
        prefill_leg(prefill, "held", [33 + i % 90 for i in range(1000)])
        recv.request_pull("held", "127.0.0.1", prefill.kv_port, list(range(63)), peer_engine_id=prefill.engine_id)
        wait_until(backend.arrived.is_set, timeout=60, what="the push of the first request")

        # The push is in flight and cannot end before the gate opens; a new request is prefilled meanwhile.
        prefill_leg(prefill, "next", [40 + i % 50 for i in range(200)])
        assert recv.poll("held").state is PullState.PENDING
        assert not backend.gate.is_set()

        backend.gate.set()
        held = wait_terminal(recv, "held", timeout=60)
        assert held.state is PullState.DONE, held
        recv.request_pull("next", "127.0.0.1", prefill.kv_port, list(range(63, 63 + 13)),
                          peer_engine_id=prefill.engine_id)
        assert wait_terminal(recv, "next", timeout=60).state is PullState.DONE
        prefill.wait_blocks_free()
    finally:
        prefill.stop()
