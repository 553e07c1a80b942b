"""--disaggregation-strategy under failure: a worker killed (SIGKILL) in the middle of a request.

For each flow: the prefill worker killed while the request waits on it, or the decode worker
killed while it streams. The client gets a clear error (an HTTP status naming the dead worker,
or, once streaming started, an SSE error event and [DONE]), nothing hangs, and the surviving
worker frees every block. tcp workers: a killed shm worker cannot unlink its pool segment.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from proxy.flows import STRATEGIES
from stack.serving import free_port
from tests.helpers import send_and_leave, wait_until
from tests.proxy.conftest import Server, start_proxies
from tests.proxy.flow_clients import GREEDY, request_body
from tests.worker_process import start_workers, stop_together

LONG = {"max_tokens": 1500, "ignore_eos": True}  # seconds of decoding: time to kill the decode worker in it
DEADLINE_S = 60.0


class Stack:
    """tcp prefill + decode workers (restarted when a test killed one), one proxy per strategy."""

    def __init__(self) -> None:
        prefill, decode = start_workers(("prefill", "tcp", ()), ("decode", "tcp", ["--kv-pull-timeout", "5"]))
        self.workers = {"prefill": prefill, "decode": decode}
        try:
            self.proxies: dict[str, Server] = dict(zip(STRATEGIES, start_proxies([[
                "--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                "--prefill-kv-port", str(prefill.kv_port),
                "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port),
                "--disaggregation-strategy", strategy, "--health-interval", "1"] for strategy in STRATEGIES])))
        except BaseException:
            stop_together(prefill, decode)
            raise

    def restart_dead(self) -> None:
        for role, worker in self.workers.items():
            if worker.proc.proc.poll() is None:
                os.kill(worker.proc.pid, signal.SIGCONT)  # a test that failed may have left it stopped
            else:
                self.workers[role] = worker.restarted()

    def stop(self) -> None:
        stop_together(*(proxy.process for proxy in self.proxies.values()), *self.workers.values())


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    started = Stack()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def proxy(stack: Stack, strategy: str) -> Iterator[Server]:
    """The strategy's proxy, once it serves again (after the last test's kill); the dead worker restarted after."""
    server = stack.proxies[strategy]
    path, body = request_body(False, False, GREEDY, 2)
    wait_until(lambda: httpx.post(f"{server.url}{path}", json=body, timeout=30).status_code == 200,
               timeout=DEADLINE_S, interval=0.5, what=f"{strategy} proxy serving")
    try:
        yield server
    finally:
        stack.restart_dead()


def _post(url: str, body: dict[str, Any], on_event: threading.Event | None = None) -> tuple[int, list[Any]]:
    """(status, SSE payloads or [the JSON body]); sets `on_event` once 5 token chunks have arrived."""
    with httpx.Client(timeout=DEADLINE_S) as client, client.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            return reply.status_code, [json.loads(reply.read())]
        payloads: list[Any] = []
        for line in reply.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                if on_event is not None and len(payloads) >= 5:
                    on_event.set()
        return 200, payloads


def _inflight(proxy: Server, role: str) -> float:
    metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(f'proxy_worker_inflight_requests{{role="{role}"'))


def _waits_on_prefill(stack: Stack, proxy: Server, strategy: str) -> bool:
    """The request is where only the prefill worker can move it on."""
    if strategy == "prefill_first":
        return _inflight(proxy, "prefill") == 1
    return stack.workers["decode"].metric("neuron_di_requests_transferring") == 1


@pytest.mark.parametrize("strategy", [s if s != "prefill_first" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in STRATEGIES])
def test_prefill_killed_mid_request_is_an_error_naming_it_and_decode_frees_its_blocks(
        stack: Stack, proxy: Server, strategy: str) -> None:
    prefill, decode = stack.workers["prefill"], stack.workers["decode"]
    path, body = request_body(False, True, GREEDY, 12)
    os.kill(prefill.proc.pid, signal.SIGSTOP)  # it takes the request but never answers it
    with ThreadPoolExecutor(1) as pool:
        reply: Future[tuple[int, list[Any]]] = pool.submit(_post, f"{proxy.url}{path}", body)
        wait_until(lambda: _waits_on_prefill(stack, proxy, strategy), timeout=DEADLINE_S, what="request on prefill")
        prefill.proc.kill()
        status, payloads = reply.result(timeout=DEADLINE_S)
    error = payloads[0]["error"]
    message = error["message"]
    if strategy != "prefill_first" and status == 503:
        # The decode leg's pull from the dead prefill failed before the prefill leg did (the decode worker's own
        # leg in decode_first, the proxy's in concurrent; under load either comes first): a kv_transfer_error
        # naming the prefill's signal plane.
        assert error["type"] == "kv_transfer_error" and f":{prefill.kv_port} was lost" in message, message
    else:
        assert status == 502, payloads  # before any token: a status, even streamed
        assert "prefill worker " in message and f"127.0.0.1:{prefill.port}" in message, message
    if strategy == "decode_first" or status == 503:  # the decode worker says it was its prefill leg or pull
        assert message.startswith(f"decode worker 127.0.0.1:{decode.port}: "), message
    decode.wait_blocks_free()


# By default the flows whose decode leg differs most (the proxy's, the decode worker's own prefill leg).
@pytest.mark.parametrize("strategy", [s if s != "prefill_first" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in STRATEGIES])
def test_decode_killed_mid_stream_is_an_error_event_and_prefill_frees_its_blocks(
        stack: Stack, proxy: Server, strategy: str) -> None:
    prefill, decode = stack.workers["prefill"], stack.workers["decode"]
    path, body = request_body(False, True, {**GREEDY, **LONG}, LONG["max_tokens"])
    streaming = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        reply: Future[tuple[int, list[Any]]] = pool.submit(_post, f"{proxy.url}{path}", body, streaming)
        assert streaming.wait(DEADLINE_S), "no tokens streamed"
        decode.proc.kill()
        status, payloads = reply.result(timeout=DEADLINE_S)
    assert status == 200 and payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    error = payloads[-2]["error"]
    assert error["code"] == 502 and f"decode worker 127.0.0.1:{decode.port}" in error["message"], error
    assert len(payloads) < LONG["max_tokens"]  # cut short, not finished before the kill
    prefill.wait_blocks_free()


def test_client_gone_in_decode_first_cancels_the_prefill_leg_decode_sent(stack: Stack) -> None:
    """The prefill worker here takes the request and never answers (a plain socket server): the decode
    worker's prefill leg ends only when the decode worker closes it, once its own client has left."""
    decode = stack.workers["decode"]
    path, body = request_body(False, False, GREEDY, 12)

    async def run() -> None:
        asked, dropped = asyncio.Event(), asyncio.Event()

        async def prefill(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:   # closed before a request came: wait for the next connection
                writer.close()
                return
            asked.set()
            await reader.read()  # until the decode worker closes the connection
            dropped.set()
            writer.close()

        server = await asyncio.start_server(prefill, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        body["kv_transfer_params"] = {"role": "decode", "remote_host": "127.0.0.1", "remote_port": free_port(),
                                      "remote_url": url}
        async with server:
            client = asyncio.ensure_future(send_and_leave(decode.port, path, body, until=asked))
            await asyncio.wait_for(client, DEADLINE_S)
            await asyncio.wait_for(dropped.wait(), DEADLINE_S)

    asyncio.run(run())
    decode.wait_blocks_free()
