"""Prometheus metrics of one proxy app (its own registry, so several apps can share a process)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.roles import DISAGGREGATED_ROLES
from proxy.conditional import PATHS
from proxy.errors import UpstreamError
from proxy.workers import KV_PROTOCOLS, WorkerRecord

# Bounds at the usual SLO targets (TTFT 0.5-5 s, ITL 50-300 ms): a percentile the planner reads is linear within
# a bucket, and with 2.5 and 5.0 s alone, TTFTs of 2.6-2.95 s read as a p90 of 4.75 s, over a 3 s target.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0,
                    1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 30.0, 60.0)


class Metrics:
    """Requests by status, TTFT, ITL, end-to-end latency, in-flight legs per worker, upstream errors,
    decode first tokens checked against prefill's, per kv_protocol, and (conditional disaggregation)
    requests by path, and the prefill queue's depth."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("proxy_requests", "Client requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("proxy_time_to_first_token_seconds", "Time to the first streamed token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("proxy_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("proxy_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inflight = Gauge("proxy_worker_inflight_requests", "Legs in flight per worker",
                              ["role", "worker"], registry=self.registry)
        self.upstream_errors = Counter("proxy_upstream_errors", "Failed legs by role and error kind",
                                       ["role", "kind"], registry=self.registry)
        self.first_token_checks = Counter(
            "proxy_first_token_checks", "Disaggregated answers whose decode first token was compared with "
            "prefill's", ["kv_protocol"], registry=self.registry)
        self.first_token_mismatches = Counter(
            "proxy_first_token_mismatches", "Disaggregated answers whose decode first token differed from "
            "prefill's (the moved KV was not intact)", ["kv_protocol"], registry=self.registry)
        self.paths = Counter("proxy_request_paths", "Requests conditional disaggregation sent by path: remote "
                             "(prefilled by a prefill worker) or local (served by a decode worker alone)",
                             ["path"], registry=self.registry)
        self.prefill_queue_depth = Gauge("proxy_prefill_queue_depth", "Prefill jobs in the global prefill queue's "
                                         "stream (waiting, or taken and not yet acked)", registry=self.registry)
        for path in PATHS:
            self.paths.labels(path)
        for kind in UpstreamError.__subclasses__():  # exported at 0 from the start too
            for role in DISAGGREGATED_ROLES:
                self.upstream_errors.labels(role, kind.__name__)
        for protocol in KV_PROTOCOLS:  # exported at 0 from the start, so that a rate exists
            self.first_token_checks.labels(protocol)
            self.first_token_mismatches.labels(protocol)

    @contextmanager
    def leg(self, worker: WorkerRecord) -> Iterator[None]:
        """Counts one leg to `worker` as in flight, and its error if it fails."""
        gauge = self.inflight.labels(worker.role, worker.address)
        gauge.inc()
        try:
            yield
        except UpstreamError as exc:
            self.upstream_errors.labels(worker.role, type(exc).__name__).inc()
            raise
        finally:
            gauge.dec()

    def first_token(self, kv_protocol: str, matched: bool) -> None:
        """Counts one checked first token, and whether decode's differed from prefill's."""
        self.first_token_checks.labels(kv_protocol).inc()
        if not matched:
            self.first_token_mismatches.labels(kv_protocol).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
