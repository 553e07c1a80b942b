"""`vllm serve` with NeuronConnector, traced: vLLM's own `llm_request` spans and the connector's pull, push
and first-step spans join the trace of the proxy's request (slow: a 1P1D vLLM stack of its own)."""
from __future__ import annotations

import dataclasses
import secrets
from typing import Iterator

import httpx
import pytest

from stack.otlp_receiver import OTLPReceiver
from stack.serving import Stack
from stack.vllm import SERVED_NAME, start_neuron_1p1d
from tests.helpers import wait_until
from tests.vllm.conftest import OPTIONS

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")
pytestmark = pytest.mark.slow

# span -> its parent span
PARENTS = {"proxy.prefill_leg": "proxy.request", "proxy.decode_leg": "proxy.request",
           "prefill.prefill": "proxy.prefill_leg", "prefill.published": "proxy.prefill_leg",
           "decode.pull": "proxy.decode_leg", "prefill.push": "decode.pull",
           "decode.pull_report": "proxy.decode_leg", "decode.first_step": "proxy.decode_leg"}


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[Stack, OTLPReceiver]]:
    with OTLPReceiver() as receiver, pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")  # vLLM's own spans: OTLP/HTTP too
        flags = ("--otlp-traces-endpoint", receiver.endpoint)
        with start_neuron_1p1d(dataclasses.replace(OPTIONS, extra_args=flags, proxy_extra=flags)) as stack:
            yield stack, receiver


def test_vllm_and_its_connector_join_the_proxys_trace(traced: tuple[Stack, OTLPReceiver]) -> None:
    stack, receiver = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0,
            "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120.0,
                      headers={"traceparent": f"00-{trace_id}-{client_span}-01"}) as reply:
        assert reply.status_code == 200
        reply.read()
    wanted = {"proxy.request", "llm_request", *PARENTS}
    try:
        wait_until(lambda: wanted <= {s.name for s in receiver.spans(trace_id)}
                   and sum(s.name == "llm_request" for s in receiver.spans(trace_id)) == 2, timeout=30.0)
    except AssertionError:
        got = sorted((s.name, s.service, s.trace_id == trace_id) for s in receiver.spans())
        raise AssertionError(f"missing {wanted - {s.name for s in receiver.spans(trace_id)}}; received {got}")
    spans = receiver.spans(trace_id)
    by_name = {s.name: s for s in spans}
    for name, parent in PARENTS.items():
        assert by_name[name].parent_id == by_name[parent].span_id, (name, parent)
    legs = {by_name["proxy.prefill_leg"].span_id, by_name["proxy.decode_leg"].span_id}
    assert {s.parent_id for s in spans if s.name == "llm_request"} == legs   # one vLLM span per leg
    assert by_name["decode.pull"].service == "neuron-di-decode-connector"
