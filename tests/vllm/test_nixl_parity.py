"""Our proxy (`--kv-protocol nixl`) over vLLM 1P1D with vLLM's own NixlConnector answers exactly as
one plain `vllm serve`: the drop-in for vLLM's toy proxy. Runs where nixl is installed."""
from __future__ import annotations

from typing import Iterator

import pytest

from stack.serving import Stack
from stack.vllm import start_nixl_1p1d
from tests.vllm.conftest import OPTIONS
from tests.vllm.test_parity import ENDPOINTS, GREEDY_WAYS, MORE_GREEDY_WAYS, SEEDED_WAYS, assert_answers_like_reference

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")
pytest.importorskip("nixl", reason="nixl is not installed")
# About 9 minutes here (NixlConnector's progress threads take both cores): run with --full.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nixl_stack() -> Iterator[Stack]:
    # Module scope: each NixlConnector server's progress thread keeps a core busy while it lives.
    with start_nixl_1p1d(OPTIONS) as stack:
        yield stack


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_nixl_1p1d_equals_one_vllm_server(reference: Stack, nixl_stack: Stack, endpoint: str, sampled: bool) -> None:
    ways = GREEDY_WAYS + MORE_GREEDY_WAYS if not sampled else SEEDED_WAYS
    assert_answers_like_reference(reference, nixl_stack, endpoint, sampled, ways)
