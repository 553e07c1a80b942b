"""OpenTelemetry tracing of one process: spans exported over OTLP/HTTP, off unless an endpoint is given.

`Tracing.start(endpoint, service)` makes one process's tracer (the proxy's, a worker's, a connector's); it
is None without `--otlp-traces-endpoint`, and every caller then does nothing. Spans leave on a background
thread in batches (the SDK's BatchSpanProcessor): a request never waits for the collector. A span that
cannot leave (the queue is full because the collector is slow or unreachable, or an export failed) is
dropped and counted: `neuron_di_trace_spans_dropped_total` next to `neuron_di_trace_spans_exported_total`
on the process's `/metrics`; a process that does not trace shows both at 0 (`export_span_counts`), so one
dashboard panel reads every stack.

W3C trace context (`traceparent`) carries a request's trace between processes: `headers(context)` for a
leg's HTTP headers, `context_from(carrier)` where it arrives.
"""
from __future__ import annotations

import argparse
import logging
import threading
import weakref
from typing import Iterator, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("neuron_di.tracing")
TRACEPARENT = "traceparent"
EXPORT_TIMEOUT_S = 2.0      # one export's HTTP timeout: a slow collector costs the export thread, never a request
MAX_QUEUED_SPANS = 4096     # spans waiting to leave; more are dropped (and counted)
BATCH_DELAY_MS = 500        # how long a span may wait for its batch
_PROPAGATOR = TraceContextTextMapPropagator()


def add_traces_endpoint_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--otlp-traces-endpoint`, the flag `vllm serve` has too, for a process that can trace."""
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="send OpenTelemetry trace spans to this OTLP/HTTP endpoint, e.g. "
                             "http://127.0.0.1:4318/v1/traces (default: no tracing)")


class SpanCounts:
    """Spans exported and dropped (thread-safe); `queued` is how many were handed on and not yet exported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.handed = self.exported = self.dropped = 0

    def add(self, handed: int = 0, exported: int = 0, dropped: int = 0) -> None:
        with self._lock:
            self.handed += handed
            self.exported += exported
            self.dropped += dropped

    @property
    def queued(self) -> int:
        return self.handed - self.exported - self.dropped


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting what it exported and what failed (dropped); closed, it drops at once."""

    def __init__(self, inner: SpanExporter, counts: SpanCounts) -> None:
        self._inner = inner
        self._counts = counts
        self.closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = SpanExportResult.FAILURE
        if not self.closed:
            try:
                result = self._inner.export(spans)
            except Exception as exc:  # the SDK's thread must go on; the batch is lost either way
                log.warning("trace export failed: %s", exc)
        ok = result is SpanExportResult.SUCCESS
        self._counts.add(exported=len(spans) if ok else 0, dropped=0 if ok else len(spans))
        return result

    def shutdown(self) -> None:
        self.closed = True
        self._inner.shutdown()


class _BoundedProcessor(SpanProcessor):
    """Hands ended spans to the batch processor unless `MAX_QUEUED_SPANS` already wait: those are dropped here
    (and counted) rather than by the SDK's queue, which would drop them without a count we can export."""

    def __init__(self, inner: BatchSpanProcessor, counts: SpanCounts) -> None:
        self._inner = inner
        self._counts = counts

    def on_end(self, span: ReadableSpan) -> None:
        if self._counts.queued >= MAX_QUEUED_SPANS:
            self._counts.add(dropped=1)
            return
        self._counts.add(handed=1)
        self._inner.on_end(span)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _CountsCollector(Collector):
    def __init__(self, counts: SpanCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("neuron_di_trace_spans_exported", "Trace spans exported to the OTLP endpoint",
                                  value=self._counts.exported)
        yield CounterMetricFamily("neuron_di_trace_spans_dropped", "Trace spans dropped: the export queue was "
                                  "full or the OTLP endpoint failed or timed out", value=self._counts.dropped)


class Tracing:
    """One process's tracer, exporting to an OTLP/HTTP endpoint (`http://HOST:4318/v1/traces`)."""

    def __init__(self, endpoint: str, service: str) -> None:
        self.endpoint = endpoint
        self.counts = SpanCounts()
        self._exporter = _CountingExporter(OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S),
                                           self.counts)
        batch = BatchSpanProcessor(self._exporter, max_queue_size=MAX_QUEUED_SPANS * 2,
                                   schedule_delay_millis=BATCH_DELAY_MS)
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
        self._provider.add_span_processor(_BoundedProcessor(batch, self.counts))
        self.tracer: Tracer = self._provider.get_tracer("neuron_di")

    @classmethod
    def start(cls, endpoint: str | None, service: str) -> Tracing | None:
        """The process's tracing, or None when no endpoint is given (tracing off)."""
        if not endpoint:
            return None
        log.info("tracing: %s spans go to %s", service, endpoint)
        return cls(endpoint, service)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Sends what it can within `timeout_s`, then drops the rest (an unreachable endpoint never holds the
        process's exit longer)."""
        self.flush(timeout_s)
        self._exporter.closed = True
        self._provider.shutdown()


_COUNTED: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()   # registries showing span counters


def export_span_counts(registry: CollectorRegistry, tracing: Tracing | None) -> None:
    """Shows `tracing`'s exported/dropped span counters on `registry`, both 0 when `tracing` is None (tracing
    off); once per registry."""
    if registry not in _COUNTED:
        _COUNTED.add(registry)
        registry.register(_CountsCollector(tracing.counts if tracing is not None else SpanCounts()))


def headers(context: Context) -> dict[str, str]:
    """The W3C trace-context headers (`traceparent`) that carry `context` to another process."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context)
    return carrier


def current_headers() -> dict[str, str]:
    """The trace-context headers naming the span current here (none when nothing is traced)."""
    return headers(otel_context.get_current())


def context_from(carrier: Mapping[str, str]) -> Context:
    """The remote parent a `traceparent` in `carrier` names (an empty context if none or malformed)."""
    return _PROPAGATOR.extract({k.lower(): v for k, v in carrier.items()})
