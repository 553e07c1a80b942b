"""A real Prometheus scraping a real 1P1D stack (our worker): the alert rules check and pass their unit tests,
every metric the Grafana dashboard queries exists in the live scrape, the phase histograms count each request
once, and the proxy's GET /status shows the fleet. A second proxy puts its prefill legs on a real NATS
JetStream prefill queue the same prefill worker takes them from: stopping that worker while requests arrive
grows the queue until Prometheus raises PrefillQueueGrowing."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from stack.nats import NatsServer
from stack.prometheus import ALERTS, PrometheusServer, dashboard_queries, prometheus_binary
from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess, start_workers

RULES_DIR = ALERTS.parent
STREAMED, WHOLE = 3, 2   # requests sent through the proxy: streamed completions, whole chat answers
BODY = {"model": "neuron-di-builtin", "prompt": "def fibonacci(n):\n    ", "max_tokens": 6, "temperature": 0.0}
CHAT = {"model": "neuron-di-builtin", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "temperature": 0.0}
QUEUE_ALERT, SHORT_FOR = "PrefillQueueGrowing", "1s"
PROXY, QUEUED = "neuron-di-proxy", "neuron-di-proxy-queued"   # the jobs scraping the two proxies
BACKLOG = 3   # requests that arrive at the queued proxy while the prefill worker is stopped


class Fleet:
    def __init__(self, proxy: Server, queued: Server, prefill: WorkerProcess, decode: WorkerProcess,
                 prometheus: PrometheusServer) -> None:
        self.proxy, self.queued, self.prefill, self.decode, self.prometheus = proxy, queued, prefill, decode, prometheus


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    prometheus_binary()  # a clear error if it is not installed
    started: list = []
    try:
        nats = NatsServer()
        started.append(nats)
        prefill, decode = start_workers(("prefill", "shm", ("--prefill-queue", nats.url)), ("decode", "shm", ()))
        started += [prefill, decode]
        with ThreadPoolExecutor(2) as pool:   # started side by side
            starting = [pool.submit(start_proxy, args) for args in (
                ["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill.port), "--decode-ip", "127.0.0.1",
                 "--decode-port", str(decode.port), "--health-interval", "0.5"],
                [f"--prefill=127.0.0.1:{prefill.port}:{prefill.kv_port}", "--decode", f"127.0.0.1:{decode.port}",
                 "--prefill-queue", nats.url, "--health-interval", "0.5", "--health-timeout", "0.5"])]
        started += [future.result().process for future in starting if future.exception() is None]
        proxy, queued = (future.result() for future in starting)
        for url in (proxy.url, queued.url):
            wait_until(lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 200, what="proxy ready")
        short = _with_short_for(QUEUE_ALERT, SHORT_FOR, tmp_path_factory.mktemp("rules") / "short_for.yml")
        prometheus = PrometheusServer({PROXY: [f"127.0.0.1:{proxy.port}"], QUEUED: [f"127.0.0.1:{queued.port}"],
                                       "neuron-di-prefill": [f"127.0.0.1:{prefill.port}"],
                                       "neuron-di-decode": [f"127.0.0.1:{decode.port}"]}, interval_s=0.5,
                                      rules=(ALERTS, short))
        started.append(prometheus)
        _send_requests(proxy.url)
        prometheus.wait_for('count(up == 1) == 4')
        prometheus.wait_for(f'sum(proxy_phase_seconds_count{{phase="request"}}) == {STREAMED + WHOLE}')
        yield Fleet(proxy, queued, prefill, decode, prometheus)
    finally:
        for item in reversed(started):
            item.stop()


def prefill_healthy(proxy: Server) -> bool:
    [prefill] = httpx.get(f"{proxy.url}/status", timeout=10).json()["workers"]["prefill"]
    return prefill["healthy"]


def _with_short_for(alert: str, for_: str, path: Path) -> Path:
    """A rule file of one group holding the shipped rule `alert` (same expression) with `for: for_`: a live
    test cannot wait the shipped minutes."""
    [rule] = [dict(r) for group in yaml.safe_load(ALERTS.read_text())["groups"] for r in group["rules"]
              if r.get("alert") == alert]
    rule["for"] = for_
    path.write_text(yaml.safe_dump({"groups": [{"name": f"short-for-{alert}", "rules": [rule]}]}))
    return path


def _send_requests(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(STREAMED):
            with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as reply:
                assert reply.status_code == 200
                assert "[DONE]" in "".join(reply.iter_text())
        for _ in range(WHOLE):
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_promtool_checks_the_rules_and_passes_their_unit_tests() -> None:
    promtool = prometheus_binary("promtool")
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([promtool, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    alerts = {rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}
    tested = {case["alertname"] for test in yaml.safe_load((RULES_DIR / "alerts_test.yml").read_text())["tests"]
              for case in test["alert_rule_test"]}
    assert alerts == tested  # every alert has a unit test
    assert {"KVBlocksHeldPastAbortTimeout", "KVIntegrityFailures", "FirstTokenMismatches", "NoHealthyWorker",
            "PrefillQueueGrowing"} <= alerts


def test_the_rules_run_on_the_live_stack_and_none_fires(fleet: Fleet) -> None:
    def evaluated() -> list[dict]:
        rules = [r for g in fleet.prometheus.api("rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r["lastEvaluation"] > "2000" for r in rules) else []

    rules = wait_until(evaluated, what="every rule evaluated")
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    assert fleet.prometheus.api("alerts")["alerts"] == []  # a healthy stack: nothing pending or firing


def test_every_metric_the_dashboard_queries_exists_in_the_live_scrape(fleet: Fleet) -> None:
    names = fleet.prometheus.metric_names()
    queries = dashboard_queries()
    used = {name for _, expr in queries for name in re.findall(r"\b(?:proxy|neuron_di)_[a-z_]+\b", expr)}
    assert used - names == set()
    # Every query evaluates (a rate, once two scrapes saw the requests); only the error panel's may stay empty
    # on a healthy stack.
    def empty() -> list[str]:
        return [expr for title, expr in queries if not fleet.prometheus.query(expr) and not title.startswith("Errors")]

    deadline = time.monotonic() + 30
    while empty() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert empty() == []


def test_phase_histograms_count_each_request_once_by_flow_and_path(fleet: Fleet) -> None:
    def count(name: str, **labels: str) -> float:
        match = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return sum(float(r["value"][1]) for r in fleet.prometheus.query(f"{name}{{{match}}}"))

    remote = {"flow": "concurrent", "path": "remote"}
    for phase in ("prefill_answer", "decode_first", "handoff", "request"):
        assert count("proxy_phase_seconds_count", job=PROXY, phase=phase, **remote) == STREAMED + WHOLE, phase
    assert count("proxy_phase_seconds_count", job=PROXY, phase="first_token", **remote) == STREAMED
    assert count("proxy_transfer_share_ratio_count", job=PROXY, **remote) == STREAMED + WHOLE
    assert count("proxy_prefill_queue_depth") == 0
    assert count("proxy_healthy_workers", job=PROXY, role="prefill") == count(
        "proxy_healthy_workers", job=PROXY, role="decode") == 1


def test_status_shows_workers_by_role_their_load_and_phase_percentiles(fleet: Fleet) -> None:
    body = httpx.get(f"{fleet.proxy.url}/status", timeout=10).json()
    assert set(body["workers"]) == {"prefill", "decode"}
    for role, worker in (("prefill", fleet.prefill), ("decode", fleet.decode)):
        [entry] = body["workers"][role]
        assert entry["address"] == f"127.0.0.1:{worker.port}"
        assert (entry["healthy"], entry["draining"], entry["why"], entry["in_flight"]) == (True, False, None, 0)
        load = entry["load"]
        assert load["kv_blocks_total"] > 0 and load["kv_blocks_used"] == 0 and load["kv_usage"] == 0
        assert load["running"] == load["waiting"] == 0
    assert body["workers"]["prefill"][0]["load"]["kv_held_oldest_seconds"] == 0
    assert body["prefill_queue_depth"] == 0
    phases = body["phases"]
    assert phases["request"]["count"] == STREAMED + WHOLE and phases["first_token"]["count"] == STREAMED
    assert 0 < phases["prefill_answer"]["p50"] <= phases["decode_first"]["p50"] <= phases["request"]["p99"]
    assert body["requests"] == {"200": STREAMED + WHOLE}


def test_prefill_worker_shows_no_block_held_once_pulled(fleet: Fleet) -> None:
    assert fleet.prefill.metric("neuron_di_kv_blocks_held") == 0
    assert fleet.prefill.metric("neuron_di_kv_held_oldest_seconds") == 0
    assert fleet.prefill.metric("neuron_di_kv_abort_timeout_seconds") == 60
    assert fleet.decode.metric("neuron_di_draining") == fleet.prefill.metric("neuron_di_draining") == 0



def test_a_prefill_queue_growing_while_its_worker_is_stopped_raises_the_alert_live(fleet: Fleet) -> None:
    """The shipped rule goes pending (its `for:` is 5 minutes), its copy with a 1 s `for:` fires; every request
    queued meanwhile is answered once the worker runs again, and the queue drains. The proxy queues them while
    the worker fails its health checks."""
    depth = f'proxy_prefill_queue_depth{{job="{QUEUED}"}}'
    assert fleet.prometheus.rule_states(QUEUE_ALERT) == {"neuron-di": "inactive", f"short-for-{QUEUE_ALERT}": "inactive"}
    pid = fleet.prefill.proc.proc.pid
    os.kill(pid, signal.SIGSTOP)
    with ThreadPoolExecutor(BACKLOG) as pool:
        try:
            # Queued all the same once the proxy found the worker failing its health checks: the stream holds the
            # jobs for whichever worker takes them.
            wait_until(lambda: not prefill_healthy(fleet.queued), what="the stopped prefill worker found unhealthy")
            answers = []
            for waiting in range(1, BACKLOG + 1):   # one more job each scrape or so: the queue grows
                answers.append(pool.submit(httpx.post, f"{fleet.queued.url}/v1/completions", json=BODY, timeout=60))
                fleet.prometheus.wait_for(f"{depth} >= {waiting}")
            raised = {"neuron-di": "pending", f"short-for-{QUEUE_ALERT}": "firing"}
            wait_until(lambda: fleet.prometheus.rule_states(QUEUE_ALERT) == raised, timeout=30, interval=0.2,
                       what=f"{QUEUE_ALERT} pending (shipped) and firing (short for)")
            [alert] = [a for a in fleet.prometheus.api("alerts")["alerts"]
                       if a["labels"]["alertname"] == QUEUE_ALERT and a["state"] == "firing"]
            assert alert["labels"]["job"] == QUEUED and float(alert["value"]) == BACKLOG
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [answer.result().status_code for answer in answers] == [200] * BACKLOG
    fleet.prometheus.wait_for(f"{depth} == 0")
    fleet.prefill.wait_blocks_free()
