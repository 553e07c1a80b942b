"""Real `vllm serve` processes on this machine's two cores, started once per session.

Test modules skip where vLLM is not installed (the README's test command installs it, so CI
runs them).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import pytest

from stack.serving import Stack, free_port
from stack.vllm import VllmOptions, start_colocated, start_neuron_1p1d
from stack.etcd import EtcdServer
from stack.xpyd import events_config
from worker.model.loader import builtin_model_path

# Short timeouts, so that the failure tests (test_stack_failures, run last) see them expire.
ABORT_TIMEOUT, PULL_TIMEOUT = 8.0, 15.0
# VLLM_USE_AOT_COMPILE=0: vLLM 0.32's default AOT compile cache fails to load here ("'function' object has no
# attribute 'finalize_loading'"), so every server compiled again (about 12 s); inductor's own cache loads, and a
# server starts in about 28 s instead of 43.
OPTIONS = VllmOptions(model=str(builtin_model_path()), max_model_len=1280, env={"VLLM_USE_AOT_COMPILE": "0"},
                      extra_config={"abort_timeout": ABORT_TIMEOUT, "pull_timeout": PULL_TIMEOUT})


# The reference server also publishes its KV cache events (tests/vllm/test_kv_events.py follows them).
REFERENCE_EVENTS_PORT = free_port()


@pytest.fixture(scope="session")
def reference() -> Iterator[Stack]:
    """One plain `vllm serve`: what the disaggregated stacks must answer token for token."""
    events = ("--kv-events-config", events_config(REFERENCE_EVENTS_PORT, "*"))
    with start_colocated(replace(OPTIONS, extra_args=(*OPTIONS.extra_args, *events))) as stack:
        yield stack


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    server = EtcdServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def neuron_stack(etcd: EtcdServer) -> Iterator[Stack]:
    """Prefill and decode `vllm serve` with NeuronConnector, registered in a real etcd, and our
    proxy discovering them there."""
    with start_neuron_1p1d(OPTIONS, etcd=etcd.endpoint) as stack:
        yield stack
