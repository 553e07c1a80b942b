"""A real Prometheus on a free loopback port scraping a stack, with the alert rules of deploy/prometheus/.

Its configuration and data live in a temporary directory that `stop()` removes. Used by the tests of the
rules and the dashboard, and by benchmarks/dashboard_png.py.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import httpx

from stack.serving import Process, StackError, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "neuron-di.json"


def prometheus_binary(name: str = "prometheus") -> str:
    binary = shutil.which(name)
    if binary is None:
        raise StackError(f"{name} is not on PATH (Debian: apt-get install prometheus)")
    return binary


def scrape_config(jobs: Mapping[str, Sequence[str]], interval_s: float, rules: Sequence[Path] = (ALERTS,)) -> str:
    """prometheus.yml scraping each job's `host:port` targets every `interval_s`, with the rule files `rules`."""
    every = f"{round(interval_s * 1000)}ms"
    lines = ["global:", f"  scrape_interval: {every}", f"  evaluation_interval: {every}",
             "rule_files:", *(f"  - {path}" for path in rules), "scrape_configs:"]
    for job, targets in jobs.items():
        lines += [f"  - job_name: {job}", "    static_configs:",
                  "      - targets: [" + ", ".join(f'"{t}"' for t in targets) + "]"]
    return "\n".join(lines) + "\n"


class PrometheusServer:
    """A started Prometheus scraping `jobs` (job name -> targets) every `interval_s` with the rule files `rules`;
    `stop()` ends it."""

    def __init__(self, jobs: Mapping[str, Sequence[str]], interval_s: float = 1.0, timeout_s: float = 30.0,
                 rules: Sequence[Path] = (ALERTS,)) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="neuron-di-prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = self.dir / "prometheus.yml"
        config.write_text(scrape_config(jobs, interval_s, rules))
        try:
            self.process = Process("prometheus", [f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
                                                  f"--web.listen-address=127.0.0.1:{self.port}"],
                                   program=prometheus_binary())
            wait_healthy(f"{self.url}/-/ready", [self.process], timeout_s)
        except BaseException:
            self.stop()
            raise

    def api(self, path: str, **params: Any) -> Any:
        """The `data` of a GET /api/v1/`path` answer; StackError if Prometheus says it failed."""
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10.0).json()
        if body.get("status") != "success":
            raise StackError(f"Prometheus /api/v1/{path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step_s)["result"]

    def rule_states(self, alert: str) -> dict[str, str]:
        """Rule group -> the state (inactive, pending, firing) of alert rule `alert` in it."""
        return {group["name"]: rule["state"] for group in self.api("rules", type="alert")["groups"]
                for rule in group["rules"] if rule["name"] == alert}

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Polls `expr` until its result is not empty; StackError at the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.process.check_alive()
            if result := self.query(expr):
                return result
            time.sleep(0.2)
        raise StackError(f"Prometheus: {expr!r} stayed empty for {timeout_s:g} s")

    def stop(self) -> None:
        if hasattr(self, "process"):
            self.process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def dashboard_queries(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the Grafana dashboard."""
    panels = json.loads(path.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]
