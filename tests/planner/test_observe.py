"""Reading the live figures: percentiles from histogram deltas, and no figures (with why) when a page is
missing, a counter went back, or the previous read is stale. Pages come from httpx's MockTransport."""
from __future__ import annotations

import asyncio
from typing import Callable

import httpx
import pytest

from planner.fleet import Member
from planner.observe import Observer, requested_rate
from planner.scrape import Scrape, parse, percentile

PROXY = "http://proxy:8000"
WORKERS = [Member("p:1", "prefill"), Member("d:1", "decode")]


def histogram(name: str, counts: dict[str, int]) -> str:
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{le="{le}"}} {n}' for le, n in counts.items()]
    total = list(counts.values())[-1]
    return "\n".join(lines + [f"{name}_count {total}", f"{name}_sum 0"]) + "\n"


def proxy_page(first_tokens: int) -> str:
    return (histogram("proxy_time_to_first_token_seconds", {"0.5": first_tokens // 2, "1.0": first_tokens,
                                                            "+Inf": first_tokens})
            + histogram("proxy_inter_token_latency_seconds", {"0.05": 10 * first_tokens, "+Inf": 10 * first_tokens}))


def counters_page(counters: dict[str, float]) -> str:
    return "".join(f"# TYPE {n} counter\n{n}_total{{model_name=\"m\"}} {v}\n" for n, v in counters.items())


def worker_page(prompt_tokens: float, busy: float) -> str:
    counters = {"neuron_di_prompt_tokens": prompt_tokens, "neuron_di_generation_tokens": prompt_tokens / 10,
                "neuron_di_engine_busy_seconds": busy, "neuron_di_prefill_step_tokens": prompt_tokens,
                "neuron_di_prefill_step_seconds": busy, "neuron_di_decode_steps": 0,
                "neuron_di_decode_step_seconds": 0, "neuron_di_decode_step_seqs": 0}
    running = "# TYPE neuron_di_requests_running gauge\nneuron_di_requests_running{model_name=\"m\"} 2\n"
    return counters_page(counters) + running


def observer(pages: Callable[[str], tuple[int, str]], max_age_s: float = 60.0, window_s: float = 0.0) -> Observer:
    def handle(request: httpx.Request) -> httpx.Response:
        status, text = pages(f"{request.url.scheme}://{request.url.host}:{request.url.port}")
        return httpx.Response(status, text=text)
    return Observer(PROXY, 0.9, max_age_s, transport=httpx.MockTransport(handle), window_s=window_s)


def test_percentile_interpolates_within_the_bucket_of_the_delta() -> None:
    before = parse(histogram("h", {"0.1": 0, "1.0": 0, "+Inf": 0}), 0.0)
    now = parse(histogram("h", {"0.1": 50, "1.0": 100, "+Inf": 100}), 1.0)
    value, count = percentile(now, before, "h", 0.9)
    assert count == 100 and value == pytest.approx(0.1 + 0.9 * 0.8)


def test_two_reads_give_each_roles_load_and_the_proxys_percentiles() -> None:
    step = {"n": 0}

    def pages(url: str) -> tuple[int, str]:
        n = step["n"]
        return 200, proxy_page(20 * n) if url == PROXY else worker_page(3000.0 * n, 2.0 * n)

    obs = observer(pages)
    first, why = asyncio.run(obs.figures(WORKERS))
    assert first is None and why == "first read of the proxy's metrics"
    step["n"] = 1
    figures, why = asyncio.run(obs.figures(WORKERS))
    assert why == "ok" and figures is not None
    assert figures.samples == 20 and 0.5 < figures.ttft_s <= 1.0 and figures.itl_s <= 0.05
    assert figures.prefill.prefill_tokens_per_busy_s == pytest.approx(1500.0)
    assert figures.prefill.running == 2 and figures.queue_depth is None and figures.queue_wait_s is None
    assert figures.prefill.latest_prompt_tokens_per_s is not None
    assert figures.decode.requested_tokens_per_s is None and figures.decode.latest_requested_tokens_per_s is None
    assert obs.in_flight == {"http://p:1": 2.0, "http://d:1": 2.0}   # for choosing whom to flip or stop


def requested(asked: float, finished_asked: float, finished_produced: float, at: float) -> Scrape:
    return parse(counters_page({"neuron_di_requested_tokens": asked, "neuron_di_finished_requested_tokens":
                                finished_asked, "neuron_di_finished_generated_tokens": finished_produced}), at)


def test_tokens_asked_for_count_at_the_share_finished_requests_produced() -> None:
    before = requested(100, 0, 0, 0.0)
    assert requested_rate([(requested(500, 0, 0, 2.0), before)], 2.0) == 200.0   # none finished: as asked
    assert requested_rate([(requested(500, 200, 50, 2.0), before)], 2.0) == 50.0  # a quarter produced
    other = (requested(300, 100, 100, 2.0), requested(100, 0, 0, 0.0))   # a second worker: shares pooled
    assert requested_rate([(requested(500, 200, 50, 2.0), before), other], 2.0) == pytest.approx(600 * 0.5 / 2)
    vllm = parse(counters_page({"neuron_di_prompt_tokens": 10}), 2.0)
    assert requested_rate([(vllm, vllm)], 2.0) is None   # a worker that does not count them


@pytest.mark.parametrize("fault, why", [
    ("missing", "metrics missing (http://d:1: HTTP 500)"),
    ("reset", "a prefill worker's counters went back (it restarted)"),
    ("stale", "previous read older than"),
])
def test_missing_reset_or_stale_metrics_give_no_figures(fault: str, why: str) -> None:
    step = {"n": 1}

    def pages(url: str) -> tuple[int, str]:
        if url == PROXY:
            return 200, proxy_page(10 * step["n"])
        if fault == "missing" and url == "http://d:1" and step["n"] == 2:
            return 500, "no"
        tokens = 100.0 if fault == "reset" and url == "http://p:1" and step["n"] == 2 else 3000.0 * step["n"]
        return 200, worker_page(tokens, 2.0 * step["n"])

    obs = observer(pages, max_age_s=-1.0 if fault == "stale" else 60.0)
    asyncio.run(obs.figures(WORKERS))
    step["n"] = 2
    figures, reason = asyncio.run(obs.figures(WORKERS))
    assert figures is None and reason.startswith(why)


@pytest.mark.parametrize("window_s, samples", [(0.0, 20), (60.0, 40)])
def test_a_window_reads_back_past_the_previous_read(window_s: float, samples: int) -> None:
    step = {"n": 0}

    def pages(url: str) -> tuple[int, str]:
        n = step["n"]
        return 200, proxy_page(20 * n) if url == PROXY else worker_page(3000.0 * n, 2.0 * n)

    obs = observer(pages, 120.0, window_s)
    for n in range(3):
        step["n"] = n
        figures, _ = asyncio.run(obs.figures(WORKERS))
    assert figures is not None and figures.samples == samples


def test_the_last_interval_alone_shows_a_shift_the_window_smooths() -> None:
    """Prompts grow tenfold in the last interval: the window's mean over three intervals lags it."""
    tokens = {"n": 0}

    def pages(url: str) -> tuple[int, str]:
        n = tokens["n"]
        return 200, proxy_page(20 * n) if url == PROXY else worker_page(1000.0 * n + (9000.0 if n == 3 else 0.0), n)

    obs = observer(pages, 120.0, 60.0)
    for n in range(4):
        tokens["n"] = n
        figures, _ = asyncio.run(obs.figures(WORKERS))
    assert figures is not None
    window, latest = figures.prefill.prompt_tokens_per_s, figures.prefill.latest_prompt_tokens_per_s
    assert latest is not None and latest > window   # 10000 of the window's 12000 tokens, in its last third


def test_a_sample_within_the_interval_gives_the_demand_of_its_tail_alone() -> None:
    """Prompts arrive in the first half of an interval and none after the observer samples the pages: the
    interval reads them, its tail reads nothing; without a sample there is no tail."""
    tokens = {"prompt": 0.0}

    def pages(url: str) -> tuple[int, str]:
        return 200, proxy_page(20) if url == PROXY else worker_page(tokens["prompt"], 1.0)

    obs = observer(pages, 120.0)
    asyncio.run(obs.figures(WORKERS))
    tokens["prompt"] = 9000.0
    asyncio.run(obs.sample(WORKERS))
    figures, _ = asyncio.run(obs.figures(WORKERS))
    assert figures is not None and figures.prefill.tail_prompt_tokens_per_s == 0.0
    assert figures.prefill.latest_prompt_tokens_per_s is not None and figures.prefill.latest_prompt_tokens_per_s > 0
    tokens["prompt"] = 18000.0
    figures, _ = asyncio.run(obs.figures(WORKERS))
    assert figures is not None and figures.prefill.tail_prompt_tokens_per_s is None   # sampled once only


def test_ttfts_just_under_the_target_read_under_it_from_the_proxys_histogram() -> None:
    """Documents answered in 2.6-2.95 s against a 3 s target: the p90 the planner reads from the proxy's own
    page stays at or under 3 s (with bounds at 2.5 and 5 s alone it read 4.75 s, a miss)."""
    from prometheus_client import generate_latest

    from proxy.metrics import Metrics

    before = parse(generate_latest(Metrics().registry).decode(), 0.0)
    metrics = Metrics()
    for i in range(20):
        metrics.ttft.observe(2.6 + 0.35 * i / 19)
    now = parse(generate_latest(metrics.registry).decode(), 1.0)
    p90, samples = percentile(now, before, "proxy_time_to_first_token_seconds", 0.9)
    assert samples == 20 and p90 is not None and p90 <= 3.0, p90
