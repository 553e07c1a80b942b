"""A draining worker refuses new requests with a clear 503 while it finishes what it has, and the proxy,
not yet aware of the drain (static 2P2D, health checks far apart), sends each refused leg to the other
worker of its role: every request succeeds with the answer it had before the drain. The drained workers
then exit 0, and every worker's KV blocks are free."""
from __future__ import annotations

import json
import os
import re
import signal
from typing import Iterator

import httpx
import pytest

from tests.helpers import wait_until
from tests.proxy.conftest import Server, proxied_2p2d
from tests.worker_process import WorkerProcess

BODY = {"model": "neuron-di-builtin", "prompt": "def fibonacci(n):\n    " * 6, "max_tokens": 12, "temperature": 0.0}
LONG = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True}
DRAINING = {"error": {"message": "this worker is draining and takes no new requests; send the request to another "
                                 "worker", "type": "worker_draining", "param": None, "code": 503}}
# The proxy's log line for a leg a draining worker refused and another worker of its role got (proxy/leg_client.py,
# or proxy/resend.py when the whole request goes again).
SENT_ELSEWHERE = (re.escape(DRAINING["error"]["message"]) +
                  r"[:;] sending the (?:{role} leg to another worker|request again, the {role} leg to )")


@pytest.fixture
def stack() -> Iterator[tuple[Server, list[WorkerProcess]]]:
    def static(workers: list[WorkerProcess]) -> list[str]:
        prefills, decodes = workers[:2], workers[2:]
        return [*(a for p in prefills for a in ("--prefill", f"127.0.0.1:{p.port}:{p.kv_port}")),
                *(a for d in decodes for a in ("--decode", f"127.0.0.1:{d.port}")), "--health-interval", "600"]

    with proxied_2p2d(["--drain-timeout", "60"], static) as running:
        yield running


def _text(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    if not reply.headers["content-type"].startswith("text/event-stream"):
        return reply.json()["choices"][0]["text"]
    events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


@pytest.mark.slow  # tests/faults/test_drain_xpyd.py drains under load by default
def test_requests_refused_by_draining_workers_are_served_by_the_others(stack) -> None:
    proxy, workers = stack
    drained = [workers[0], workers[2]]  # one prefill, one decode worker
    with httpx.Client(timeout=120) as client:
        want = _text(client.post(f"{proxy.url}/v1/completions", json=BODY))
        with client.stream("POST", f"{drained[0].url}/v1/completions", json=LONG) as busy_p, \
                client.stream("POST", f"{drained[1].url}/v1/completions", json=LONG) as busy_d:
            lines = [busy.iter_lines() for busy in (busy_p, busy_d)]
            assert [next(line for line in it if line.startswith("data: ")) for it in lines]  # both running
            os.kill(drained[0].proc.pid, signal.SIGTERM)
            assert client.post(f"{drained[1].url}/drain").status_code == 202
            for worker in drained:
                wait_until(lambda: client.get(f"{worker.url}/health").json()["draining"], timeout=10,
                           what="the worker draining")
                health = client.get(f"{worker.url}/health")
                assert health.status_code == 200 and health.json()["status"] == "draining"
                refused = client.post(f"{worker.url}/v1/completions", json=BODY)
                assert refused.status_code == 503 and refused.json() == DRAINING
                assert refused.headers["Retry-After"] == "1"
            # Round-robin sends half of these legs to the draining workers first.
            for stream in (False, True, False, True):
                assert _text(client.post(f"{proxy.url}/v1/completions", json={**BODY, "stream": stream})) == want
            for it in lines:  # the running requests run to their end
                events = [line.removeprefix("data: ") for line in it if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and len(events) == LONG["max_tokens"]  # the other tokens, [DONE]
                assert all("choices" in json.loads(e) for e in events[:-1])
    for worker in drained:
        assert worker.proc.proc.wait(timeout=60) == 0, worker.proc.output()[-3000:]
        assert "drained: nothing left in flight" in worker.proc.output()
    log = proxy.process.output()
    assert re.search(SENT_ELSEWHERE.format(role="prefill"), log), log[-3000:]  # with a new decode leg naming it
    assert re.search(SENT_ELSEWHERE.format(role="decode"), log), log[-3000:]  # it pulls the same prefill's KV
    for worker in (workers[1], workers[3]):
        worker.wait_blocks_free()
