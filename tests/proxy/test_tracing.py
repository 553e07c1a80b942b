"""Tracing across real processes: a proxy, a prefill and a decode worker export their spans over OTLP/HTTP to
a receiver in the test (stack/otlp_receiver.py, decoding with opentelemetry-proto)."""
from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Iterator

import httpx
import pytest

from stack.otlp_receiver import OTLPReceiver, ReceivedSpan
from stack.serving import free_port, wait_healthy
from stack.worker_metrics import metric
from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess

PROMPT = "def fibonacci(n):\n    "
BODY = {"model": "neuron-di-builtin", "prompt": PROMPT, "max_tokens": 32, "temperature": 0.0, "stream": True}
# span -> its parent span, in one streamed disaggregated request (common/trace_spans.py draws the tree)
PARENTS = {
    "proxy.route": "proxy.request", "proxy.prefill_leg": "proxy.request", "proxy.decode_leg": "proxy.request",
    "prefill.request": "proxy.prefill_leg", "decode.request": "proxy.decode_leg",
    "prefill.queue": "prefill.request", "prefill.prefill": "prefill.request", "prefill.published": "prefill.request",
    "prefill.push": "decode.pull",
    "decode.admission": "decode.request", "decode.pull": "decode.request", "decode.pull_report": "decode.request",
    "decode.first_step": "decode.request", "decode.stream": "decode.request",
}
# The phase spans (not the legs nor the requests): with each leg's time on the wire (the leg's span outside
# its worker's request span) they should account for the client's whole wait.
PHASES = [name for name in PARENTS if not name.endswith((".request", "_leg"))]
REQUESTS = 2  # per proxy, against a failing collector
LEGS = {"proxy.prefill_leg": "prefill.request", "proxy.decode_leg": "decode.request"}


class Traced:
    def __init__(self, receiver: OTLPReceiver, proxy: Server, prefill: WorkerProcess, decode: WorkerProcess) -> None:
        self.receiver, self.proxy, self.prefill, self.decode = receiver, proxy, prefill, decode


@pytest.fixture(scope="module")
def traced() -> Iterator[Traced]:
    with OTLPReceiver() as receiver, ThreadPoolExecutor(2) as pool:
        flags = ["--otlp-traces-endpoint", receiver.endpoint]
        # Started and stopped side by side: the module's cost is mostly theirs.
        starting = [pool.submit(WorkerProcess, role, "shm", flags) for role in ("prefill", "decode")]
        wait(starting)
        workers = [f.result() for f in starting if f.exception() is None]
        proxy = None
        try:
            prefill, decode = (f.result() for f in starting)
            proxy = start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port),
                                 "--prefill-kv-port", str(prefill.kv_port), "--decode-ip", "127.0.0.1",
                                 "--decode-port", str(decode.port), *flags])
            yield Traced(receiver, proxy, prefill, decode)
        finally:
            stopping = [proxy.process.stop] if proxy is not None else []
            list(pool.map(lambda stop: stop(), stopping + [worker.stop for worker in workers]))


def streamed(url: str, headers: dict[str, str] | None = None) -> str:
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=BODY, headers=headers or {}, timeout=60.0) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
    return text


def covered(intervals: list[tuple[int, int]], start: int, end: int) -> float:
    """The share of [start, end] the union of `intervals` covers."""
    total, reach = 0, start
    for first, last in sorted(intervals):
        lo, hi = max(first, reach), min(last, end)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total / (end - start)


def test_one_streamed_request_is_one_trace_across_the_three_processes(traced: Traced) -> None:
    streamed(traced.proxy.url)  # the first request opens the proxy's connections to the workers
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    text = streamed(traced.proxy.url, {"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert text
    wanted = {"proxy.request", *PARENTS}

    def spans() -> dict[str, ReceivedSpan]:
        return {s.name: s for s in traced.receiver.spans(trace_id)}
    wait_until(lambda: wanted <= set(spans()), timeout=20.0)
    by_name = spans()
    assert len(traced.receiver.spans(trace_id)) == len(wanted), sorted(s.name for s in traced.receiver.spans(trace_id))
    root = by_name["proxy.request"]
    assert root.parent_id == client_span and root.service == "neuron-di-proxy"
    for name, parent in PARENTS.items():
        assert by_name[name].parent_id == by_name[parent].span_id, (name, parent)
        assert not by_name[name].error, name
    assert {by_name["prefill.push"].service, by_name["decode.pull"].service} == {"neuron-di-prefill",
                                                                               "neuron-di-decode"}
    phases = [(by_name[n].start_ns, by_name[n].end_ns) for n in PHASES]
    wire = [interval for leg, request in LEGS.items() for interval in (
        (by_name[leg].start_ns, by_name[request].start_ns), (by_name[request].end_ns, by_name[leg].end_ns))]
    share, alone = covered(phases + wire, root.start_ns, root.end_ns), covered(phases, root.start_ns, root.end_ns)
    print(f"phase spans and legs on the wire cover {share:.1%} of the request's {root.seconds * 1000:.1f} ms "
          f"({(1 - share) * root.seconds * 1000:.1f} ms not; phase spans alone {alone:.1%})")
    assert share >= 0.95
    assert metric(traced.proxy.url, "neuron_di_trace_spans_exported_total", 0.0) >= 3
    assert metric(traced.proxy.url, "neuron_di_trace_spans_dropped_total", 0.0) == 0


def test_a_collector_unreachable_or_late_drops_and_counts_spans_and_requests_go_on(traced: Traced) -> None:
    with OTLPReceiver(delay_s=30.0) as late:  # answers each export long after the exporter gave up on it
        endpoints = [f"http://127.0.0.1:{free_port()}/v1/traces", late.endpoint]  # nobody listens on the first
        proxies = [start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(traced.prefill.port),
                                "--prefill-kv-port", str(traced.prefill.kv_port), "--decode-ip", "127.0.0.1",
                                "--decode-port", str(traced.decode.port), "--otlp-traces-endpoint", endpoint],
                               wait=False) for endpoint in endpoints]
        try:
            for proxy in proxies:
                wait_healthy(f"{proxy.url}/health", [proxy.process], 30)
            expected = streamed(traced.proxy.url)
            for _ in range(REQUESTS):
                for proxy in proxies:
                    assert streamed(proxy.url) == expected
            for proxy in proxies:
                wait_until(lambda: metric(proxy.url, "neuron_di_trace_spans_dropped_total", 0.0) == 4 * REQUESTS,
                           timeout=20.0)  # each request's proxy.request, proxy.route and two leg spans
                assert metric(proxy.url, "neuron_di_trace_spans_exported_total", 0.0) == 0
        finally:
            for proxy in proxies:
                proxy.process.stop()


def test_decode_first_the_decode_workers_prefill_leg_joins_the_trace(traced: Traced) -> None:
    proxy = start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(traced.prefill.port),
                         "--prefill-kv-port", str(traced.prefill.kv_port), "--decode-ip", "127.0.0.1",
                         "--decode-port", str(traced.decode.port), "--disaggregation-strategy", "decode_first",
                         "--otlp-traces-endpoint", traced.receiver.endpoint])
    try:
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        assert streamed(proxy.url, {"traceparent": f"00-{trace_id}-{client_span}-01"})
        wanted = {"proxy.request", "proxy.decode_leg", "decode.request", "prefill.request", "prefill.push"}
        wait_until(lambda: wanted <= {s.name for s in traced.receiver.spans(trace_id)}, timeout=20.0)
        by_name = {s.name: s for s in traced.receiver.spans(trace_id)}
        assert "proxy.prefill_leg" not in by_name   # the decode worker sends the prefill leg itself
        assert by_name["decode.request"].parent_id == by_name["proxy.decode_leg"].span_id
        assert by_name["prefill.request"].parent_id == by_name["decode.request"].span_id
        assert by_name["prefill.push"].parent_id == by_name["decode.pull"].span_id
    finally:
        proxy.process.stop()
