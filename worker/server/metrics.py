"""Prometheus metrics of one worker server, on a registry of its own (several apps may share a process)."""
from __future__ import annotations

import time

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.engine.llm_engine import EngineStats
from worker.engine.step_counters import StepCounters

# Latency buckets from 1 ms to ~1 min: a CPU engine's first token can take seconds under load.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The worker's series: engine gauges, token counters, latency histograms, finished requests."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        self.running = gauge("neuron_di_requests_running", "Requests in the running batch.")
        self.waiting = gauge("neuron_di_requests_waiting", "Requests waiting to be scheduled.")
        self.transferring = gauge("neuron_di_requests_transferring",
                                  "Requests whose KV blocks are held for a transfer between prefill and decode.")
        self.blocks_used = gauge("neuron_di_kv_blocks_used", "KV cache blocks held by requests.")
        self.blocks_total = gauge("neuron_di_kv_blocks_total", "KV cache blocks in the pool.")
        self.prompt_tokens = Counter("neuron_di_prompt_tokens", "Prompt tokens of the requests received.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("neuron_di_generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry)
        # What the requests received ask for (max_tokens), and what the finished ones asked for and produced:
        # the decode demand on its way, before its tokens are produced.
        self.requested_tokens = Counter("neuron_di_requested_tokens", "Output tokens asked for by requests received.",
                                        labels, registry=self.registry)
        self.finished_requested_tokens = Counter(
            "neuron_di_finished_requested_tokens", "Output tokens asked for by requests finished.", labels,
            registry=self.registry)
        self.finished_generated_tokens = Counter(
            "neuron_di_finished_generated_tokens", "Output tokens produced by requests finished.", labels,
            registry=self.registry)
        self.ttft = Histogram("neuron_di_ttft_seconds", "Time from admission to the first token.", labels,
                              buckets=_BUCKETS, registry=self.registry)
        self.itl = Histogram("neuron_di_itl_seconds", "Time between consecutive output tokens.", labels,
                             buckets=_BUCKETS, registry=self.registry)
        self.transfer_seconds = Histogram(
            "neuron_di_kv_transfer_seconds", "Prefill: time of one KV push to a decode worker.", labels,
            buckets=_BUCKETS, registry=self.registry)
        self.transfer_blocks = Counter("neuron_di_kv_transfer_blocks", "Prefill: KV blocks pushed.", labels,
                                       registry=self.registry)
        self.transfer_bytes = Counter("neuron_di_kv_transfer_bytes", "Prefill: KV bytes pushed.", labels,
                                      registry=self.registry)
        self.pulls = Counter("neuron_di_kv_pulls", "Decode: KV pulls completed (one per disaggregated request).",
                             labels, registry=self.registry)
        self.blocks_pulled = Counter("neuron_di_kv_blocks_pulled", "Decode: KV blocks pulled from prefill workers.",
                                     labels, registry=self.registry)
        self.bytes_pulled = Counter("neuron_di_kv_bytes_pulled", "Decode: KV bytes pulled from prefill workers.",
                                    labels, registry=self.registry)
        self.blocks_skipped = Counter(
            "neuron_di_kv_blocks_skipped", "Decode: prompt KV blocks not pulled, found in this worker's prefix cache.",
            labels, registry=self.registry)
        self.bytes_skipped = Counter(
            "neuron_di_kv_bytes_skipped", "Decode: prompt KV bytes not pulled, found in this worker's prefix cache.",
            labels, registry=self.registry)
        self.integrity_checks = Counter(
            "neuron_di_kv_integrity_checks", "Decode: KV pulls whose checksum was verified (--kv-integrity-check).",
            labels, registry=self.registry)
        self.integrity_failures = Counter(
            "neuron_di_kv_integrity_failures", "Decode: KV pulls failed because their checksum did not match.",
            labels, registry=self.registry)
        self.requests = Counter("neuron_di_requests", "Requests answered, by finish reason or error status.",
                                [*labels, "outcome"], registry=self.registry)
        self.model_name = model_name
        self.steps = _TotalsCollector(model_name, _STEP_SERIES, StepCounters())
        self.write_back = _TotalsCollector(model_name, _WRITE_BACK_SERIES, None)
        self.registry.register(self.steps)
        self.registry.register(self.write_back)
        for counter in (self.prompt_tokens, self.generation_tokens, self.requested_tokens,
                        self.finished_requested_tokens, self.finished_generated_tokens, self.integrity_checks,
                        self.integrity_failures, self.pulls, self.blocks_pulled, self.bytes_pulled, self.blocks_skipped,
                        self.bytes_skipped):
            counter.labels(model_name)    # shown as 0 before the first request or pull

    def observe_stats(self, stats: EngineStats) -> None:
        self.steps.totals, self.write_back.totals = stats.counters, stats.write_back
        self.running.labels(self.model_name).set(stats.num_running)
        self.waiting.labels(self.model_name).set(stats.num_waiting)
        self.transferring.labels(self.model_name).set(stats.num_transferring)
        self.blocks_used.labels(self.model_name).set(stats.num_blocks_used)
        self.blocks_total.labels(self.model_name).set(stats.num_blocks_total)

    def transfer_done(self, seconds: float, num_blocks: int, num_bytes: int) -> None:
        """Counts one completed KV push; thread-safe (called from the signal plane's thread)."""
        self.transfer_seconds.labels(self.model_name).observe(seconds)
        self.transfer_blocks.labels(self.model_name).inc(num_blocks)
        self.transfer_bytes.labels(self.model_name).inc(num_bytes)

    def pull_done(self, num_pulled: int, num_skipped: int, block_bytes: int) -> None:
        """Counts one completed KV pull: the blocks it moved and the cached ones it did not."""
        self.pulls.labels(self.model_name).inc()
        self.blocks_pulled.labels(self.model_name).inc(num_pulled)
        self.bytes_pulled.labels(self.model_name).inc(num_pulled * block_bytes)
        self.blocks_skipped.labels(self.model_name).inc(num_skipped)
        self.bytes_skipped.labels(self.model_name).inc(num_skipped * block_bytes)

    def integrity_checked(self, ok: bool) -> None:
        """Counts one pull whose checksum was compared, and a mismatch."""
        self.integrity_checks.labels(self.model_name).inc()
        if not ok:
            self.integrity_failures.labels(self.model_name).inc()

    def request_done(self, outcome: str) -> None:
        """Counts a finished request: a finish reason ("stop", "length", "abort") or an HTTP status."""
        self.requests.labels(self.model_name, outcome).inc()

    def timer(self, num_prompt_tokens: int, max_tokens: int) -> RequestTimer:
        """Counts a request as it arrives, before the engine admits it (after its current step, which a prefill
        can make seconds long): a planner reads the demand, not only what the engine got to."""
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.requested_tokens.labels(self.model_name).inc(max_tokens)
        return RequestTimer(self, max_tokens)

    def render(self, stats: EngineStats | None) -> bytes:
        if stats is not None:
            self.observe_stats(stats)
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request bookkeeping: TTFT at the first token, then one ITL sample per token; at the end, the
    tokens it asked for and those it produced."""

    def __init__(self, metrics: ServerMetrics, max_tokens: int) -> None:
        self._metrics = metrics
        self._max_tokens = max_tokens
        self._produced = 0
        self._start = self._last = time.monotonic()
        self._seen_first = False

    def tokens(self, count: int, finished: bool = False) -> None:
        model = self._metrics.model_name
        self._produced += max(count, 0)
        if finished:
            self._metrics.finished_requested_tokens.labels(model).inc(self._max_tokens)
            self._metrics.finished_generated_tokens.labels(model).inc(self._produced)
        if count <= 0:
            return
        now = time.monotonic()
        self._metrics.generation_tokens.labels(model).inc(count)
        if not self._seen_first:
            self._metrics.ttft.labels(model).observe(now - self._start)
            self._seen_first, self._last, count = True, now, count - 1
        # Tokens that arrive together (e.g. held back by a stop string) share the gap evenly.
        for _ in range(count):
            self._metrics.itl.labels(model).observe((now - self._last) / count)
        self._last = now


# name, help, StepCounters field: what a planner reads to size prefill and decode fleets
_STEP_SERIES = (
    ("neuron_di_engine_busy_seconds", "Seconds the engine spent computing steps.", "busy_seconds"),
    ("neuron_di_prefill_steps", "Steps that only prefilled.", "prefill_steps"),
    ("neuron_di_prefill_step_seconds", "Seconds spent in steps that only prefilled.", "prefill_seconds"),
    ("neuron_di_prefill_step_tokens", "Prompt tokens computed by steps that only prefilled.", "prefill_tokens"),
    ("neuron_di_decode_steps", "Steps that only decoded.", "decode_steps"),
    ("neuron_di_decode_step_seconds", "Seconds spent in steps that only decoded.", "decode_seconds"),
    ("neuron_di_decode_step_seqs", "Sequences decoded by steps that only decoded (their batch sizes, summed).",
     "decode_seqs"),
)


# name, help, WriteBackCounts field: a worker's answers' KV written back (--kv-write-back)
_WRITE_BACK_SERIES = (
    ("neuron_di_kv_write_back_offers", "Decode: finished answers whose KV was offered to their prefill worker.",
     "offered"),
    ("neuron_di_kv_write_back_cached_blocks", "Prefill: KV blocks of answers pulled into the prefix cache.",
     "cached_blocks"),
    ("neuron_di_kv_write_back_refused", "Prefill: answers' KV offered and not taken (no room, or malformed).",
     "refused"),
    ("neuron_di_kv_write_back_failed", "Prefill: pulls of answers' KV that failed.", "failed"),
)


class _TotalsCollector(Collector):
    """Running totals the engine thread keeps (`totals`, a copy; None: nothing to show) as Prometheus counters."""

    def __init__(self, model_name: str, series: tuple[tuple[str, str, str], ...], totals: object | None) -> None:
        self.model_name, self.series, self.totals = model_name, series, totals

    def collect(self) -> Iterator[Metric]:
        if self.totals is None:
            return
        for name, doc, attr in self.series:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(self.totals, attr)))
            yield family
