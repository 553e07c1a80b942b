"""ServerMetrics: one registry per app, and the latency bookkeeping of one request."""
from __future__ import annotations

from worker.engine.llm_engine import EngineStats
from worker.server.metrics import ServerMetrics


def sample(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_two_apps_in_one_process_keep_separate_series() -> None:
    first, second = ServerMetrics("m"), ServerMetrics("m")
    first.observe_stats(EngineStats(num_running=2, num_waiting=1, num_blocks_used=7, num_blocks_total=64))
    first.request_done("stop")
    assert sample(first, "neuron_di_kv_blocks_used") == 7 and sample(first, "neuron_di_requests_waiting") == 1
    assert sample(second, "neuron_di_kv_blocks_used") is None
    assert sample(first, "neuron_di_requests_total", outcome="stop") == 1
    assert sample(second, "neuron_di_requests_total", outcome="stop") is None
    assert b"neuron_di_kv_blocks_total" in first.render(None)


def test_timer_counts_first_token_latency_once_and_one_gap_per_later_token() -> None:
    metrics = ServerMetrics("m")
    timer = metrics.timer(num_prompt_tokens=5, max_tokens=8)
    timer.tokens(0)
    timer.tokens(1)
    timer.tokens(1)
    timer.tokens(3)
    assert sample(metrics, "neuron_di_prompt_tokens_total") == 5
    assert sample(metrics, "neuron_di_generation_tokens_total") == 5
    assert sample(metrics, "neuron_di_ttft_seconds_count") == 1
    assert sample(metrics, "neuron_di_itl_seconds_count") == 4


def test_finished_requests_count_what_they_asked_for_and_produced() -> None:
    metrics = ServerMetrics("m")
    first, second = metrics.timer(num_prompt_tokens=5, max_tokens=8), metrics.timer(num_prompt_tokens=5, max_tokens=10)
    first.tokens(1)
    first.tokens(2, finished=True)   # stopped early: 3 of 8
    second.tokens(4)
    assert sample(metrics, "neuron_di_requested_tokens_total") == 18   # both, at admission
    assert sample(metrics, "neuron_di_finished_requested_tokens_total") == 8
    assert sample(metrics, "neuron_di_finished_generated_tokens_total") == 3
    second.tokens(0, finished=True)   # a last output without a token still ends it
    assert sample(metrics, "neuron_di_finished_requested_tokens_total") == 18
    assert sample(metrics, "neuron_di_finished_generated_tokens_total") == 7
