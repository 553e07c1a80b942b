"""Every request shape one `vllm serve` answers, answered the same through our proxy over vLLM 1P1D with
NeuronConnector: logprobs, n, lists of prompts, echo and prompt logprobs, structured output, sampling
parameters, usage; greedy and seeded, streamed and not; KV back to 0 after each."""
from __future__ import annotations

import httpx
import pytest

from stack.serving import Stack
from stack.vllm import SERVED_NAME
from stack.worker_metrics import metric
from tests.surface import PREFILL_ALONE, SHAPES, assert_load_equal, assert_shape_equal
from tests.vllm.test_parity import kv_usage_back_to_zero

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")


# Seconds of the default suite: the shapes whose paths a default one takes (fan-out, the seam, the prefill
# worker alone; JSON schema: the concurrency test below) run with --full.
FAST_SHAPES = ("logprobs", "chat-n", "prompt-list", "echo-max-tokens-0", "sampling", "stop-strings")


@pytest.mark.parametrize("shape", [s if s in FAST_SHAPES else pytest.param(s, marks=pytest.mark.slow)
                                   for s in SHAPES])
def test_shape_equals_one_vllm_server(reference: Stack, neuron_stack: Stack, shape: str) -> None:
    decode = neuron_stack.worker_urls["decode"]
    decode_requests = metric(decode, "vllm:request_success_total")
    with httpx.Client(timeout=120) as client:
        largest = assert_shape_equal(client, SERVED_NAME, reference.url, neuron_stack.url, shape)
    kv_usage_back_to_zero(neuron_stack)
    if shape in PREFILL_ALONE:
        assert metric(decode, "vllm:request_success_total") == decode_requests
    print(f"{shape}: largest logprob difference {largest:.2e}")


def test_prompt_lists_n3_json_schema_at_concurrency_8(reference: Stack, neuron_stack: Stack) -> None:
    assert_load_equal(SERVED_NAME, reference.url, neuron_stack.url)
    kv_usage_back_to_zero(neuron_stack)
    assert metric(neuron_stack.url, "proxy_first_token_mismatches_total") == 0
