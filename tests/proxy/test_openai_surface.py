"""Every request shape our `both` worker answers, answered the same through the proxy over our prefill and
decode workers (greedy and seeded, streamed and not), KV blocks back to 0 after each; what the worker
does not serve, the same 400."""
from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from tests.proxy.conftest import Server, proxied_1p1d
from tests.surface import PREFILL_ALONE, SHAPES, assert_shape_equal
from tests.vllm.client import metric
from tests.worker_process import WorkerProcess

MODEL = "neuron-di-builtin"
REFUSED = ("json-schema",)  # structured output: our worker does not serve it
# Seconds of the default suite: the shapes whose paths another default shape takes run with --full.
FAST = ("logprobs", "chat-n", "prompt-list", "echo-max-tokens-0", "json-schema", "sampling", "usage")


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Server, WorkerProcess, WorkerProcess, WorkerProcess]]:
    with proxied_1p1d() as started:
        yield started


@pytest.mark.parametrize("shape", [s if s in FAST else pytest.param(s, marks=pytest.mark.slow) for s in SHAPES])
def test_shape_equals_one_both_worker(stack: tuple[Server, WorkerProcess, WorkerProcess, WorkerProcess],
                                      shape: str) -> None:
    proxy, prefill, decode, both = stack
    pulls = metric(decode.url, "neuron_di_kv_pulls_total")
    with httpx.Client(timeout=120) as client:
        largest = assert_shape_equal(client, MODEL, both.url, proxy.url, shape, REFUSED)
    for worker in (prefill, decode, both):
        worker.wait_blocks_free()
    if shape in PREFILL_ALONE:
        assert metric(decode.url, "neuron_di_kv_pulls_total") == pulls
    print(f"{shape}: largest logprob difference {largest:.2e}")
