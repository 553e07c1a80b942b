"""Timeline phases -> spans (common/trace_spans.py), exported for real over OTLP/HTTP to a receiver in the test."""
from __future__ import annotations

import secrets
from typing import Iterator

import pytest
from prometheus_client import generate_latest

from common import timeline as tl
from common.trace_spans import REQUEST, RESPONDED, attach
from common.tracing import Tracing
from stack.otlp_receiver import OTLPReceiver
from stack.serving import free_port
from tests.helpers import wait_until


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as started:
        yield started


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def test_a_connector_decode_traces_its_pull_under_the_requests_traceparent(receiver: OTLPReceiver) -> None:
    tracing = Tracing(receiver.endpoint, "test-decode-connector")
    timeline = tl.Timeline(tl.DECODE)
    spans = attach(tracing, timeline, http=False)
    assert spans is not None and attach(tracing, timeline) is spans   # once per timeline
    parent, trace_id, parent_id = traceparent()
    spans.adopt("u1", parent)
    for at, phase in enumerate((tl.ADMITTED, tl.PULL_STARTED, tl.LOOKUP_ANSWERED, tl.PULL_REPORTED, tl.FIRST_STEP)):
        timeline.mark("u1", phase, 100.0 + at)
    tracing.flush()
    got = {s.name: s for s in receiver.spans(trace_id)}
    assert set(got) == {"decode.pull", "decode.pull_report", "decode.first_step"}   # no HTTP spans here
    assert all(s.parent_id == parent_id and not s.error for s in got.values())
    assert (got["decode.pull"].start_ns, got["decode.pull"].end_ns) == (101 * 10**9, 102 * 10**9)
    assert "neuron_di_trace_spans_exported_total 3.0" in generate_latest(timeline.registry).decode()
    tracing.shutdown()


def test_a_failed_request_ends_its_open_spans_with_an_error(receiver: OTLPReceiver) -> None:
    tracing = Tracing(receiver.endpoint, "test-decode")
    timeline = tl.Timeline(tl.DECODE)
    spans = attach(tracing, timeline)
    assert spans is not None
    parent, trace_id, _ = traceparent()
    spans.adopt("u2", parent)
    spans.phase("u2", REQUEST, 10.0)
    timeline.mark("u2", tl.ADMITTED, 11.0)
    timeline.mark("u2", tl.PULL_STARTED, 12.0)
    timeline.fail("u2", "the pull timed out")
    spans.phase("u2", RESPONDED, 20.0)
    tracing.flush()
    got = {s.name: s for s in receiver.spans(trace_id)}
    assert set(got) == {"decode.admission", "decode.pull"}
    assert got["decode.pull"].error and got["decode.pull"].end_ns == 20 * 10**9
    assert spans.headers("u2", "pull") == {}   # forgotten once done
    tracing.shutdown()


def test_spans_an_unreachable_endpoint_cannot_take_are_dropped_and_counted() -> None:
    tracing = Tracing(f"http://127.0.0.1:{free_port()}/v1/traces", "test-proxy")
    timeline = tl.Timeline(tl.PROXY)
    attach(tracing, timeline)
    for phase in (tl.RECEIVED, tl.PREFILL_SENT, tl.PREFILL_ANSWERED, tl.DECODE_SENT, tl.DONE):
        timeline.mark("u3", phase)
    wait_until(lambda: tracing.counts.dropped == 3, timeout=10.0)
    assert tracing.counts.exported == 0
    assert "neuron_di_trace_spans_dropped_total 3.0" in generate_latest(timeline.registry).decode()
    tracing.shutdown()


def test_tracing_is_off_without_an_endpoint() -> None:
    assert Tracing.start(None, "x") is None and Tracing.start("", "x") is None
    timeline = tl.Timeline(tl.PROXY)
    assert attach(None, timeline) is None and attach(None, timeline) is None
    page = generate_latest(timeline.registry).decode()   # the counters a dashboard reads exist, once, at 0
    assert page.count("neuron_di_trace_spans_exported_total 0.0") == page.count(
        "neuron_di_trace_spans_dropped_total 0.0") == 1


def test_a_prefill_leg_that_fails_before_it_publishes_ends_its_spans_with_its_answer(receiver: OTLPReceiver) -> None:
    tracing = Tracing(receiver.endpoint, "test-prefill")
    spans = attach(tracing, tl.Timeline(tl.PREFILL))
    assert spans is not None
    root = tracing.tracer.start_span("prefill.request")
    trace_id = format(root.get_span_context().trace_id, "032x")
    spans.begin("u4", root, 10.0)
    spans.phase("u4", tl.ADMITTED, 11.0)
    spans.fail("u4", "HTTP 500")
    spans.phase("u4", RESPONDED, 12.0)
    root.end()
    tracing.flush()
    got = {s.name: s for s in receiver.spans(trace_id)}
    assert not got["prefill.queue"].error
    assert got["prefill.prefill"].error and got["prefill.prefill"].end_ns == 12 * 10**9
    assert spans.headers("u4", "prefill") == {}
    tracing.shutdown()
