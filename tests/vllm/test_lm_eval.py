"""lm-evaluation-harness's `local-completions` model scores a tiny multiple-choice task (loglikelihood: echo +
logprobs, which the prefill worker serves alone) and a tiny generation task (generate_until: disaggregated,
four prompts per request) the same through our proxy over vLLM 1P1D as against one `vllm serve`."""
from __future__ import annotations

from pathlib import Path

import pytest

from stack.serving import Stack
from stack.vllm import SERVED_NAME
from tests.lm_eval_check import assert_same_scores, evaluate
from tests.surface import LOGPROB_TOLERANCE
from tests.vllm.test_parity import kv_usage_back_to_zero

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[test])")
# About 15 s (lm-eval's imports included): its paths, echo + logprobs on the prefill worker alone and lists of
# token-id prompts disaggregated, are tests/vllm/test_openai_surface.py's by default.
pytestmark = pytest.mark.slow


def test_lm_eval_scores_through_the_proxy_equal_one_vllm_server(reference: Stack, neuron_stack: Stack,
                                                                  tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    want = evaluate(reference.url, SERVED_NAME, tmp_path)
    got = evaluate(neuron_stack.url, SERVED_NAME, tmp_path)
    assert_same_scores(got, want, LOGPROB_TOLERANCE * 8)  # a sum over up to 8 tokens' logprobs
    kv_usage_back_to_zero(neuron_stack)
