"""SIGTERM while a request streams: the stream ends with an error event, then [DONE], not a cut connection;
a drain says what it waits for, and a second Ctrl-C ends it at once."""
from __future__ import annotations

import json
import os
import signal

import httpx

from tests.helpers import wait_until
from tests.worker_process import WorkerProcess


def test_sigterm_mid_stream_ends_the_stream_with_an_error_event() -> None:
    worker = WorkerProcess(extra=["--shutdown-grace", "0"])
    try:
        max_model_len = httpx.get(f"{worker.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        body = {"prompt": [5, 6, 7], "max_tokens": max_model_len - 3, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():  # a cut connection raises here
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 1:
                        os.kill(worker.proc.pid, signal.SIGTERM)
        assert worker.proc.proc.wait(timeout=30) == 0
    finally:
        worker.stop()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {"error": {"message": "the engine is shutting down", "type": "server_error",
                                                "param": None, "code": 500}}
    assert all("choices" in json.loads(event) for event in events[:-2])


def test_a_drain_says_what_it_waits_for_and_a_second_ctrl_c_stops_the_worker_now() -> None:
    worker = WorkerProcess("prefill")
    try:
        # A prefill leg nobody pulls: its KV stays held for the --kv-abort-timeout (60 s), and the drain waits.
        leg = {"prompt": [5, 6, 7], "max_tokens": 1, "kv_transfer_params": {"role": "prefill", "request_id": "held"}}
        assert httpx.post(f"{worker.url}/v1/completions", json=leg, headers={"X-Request-Id": "held"},
                          timeout=60).status_code == 200
        os.kill(worker.proc.pid, signal.SIGINT)
        wait_until(lambda: "draining: waiting for the KV of 1 request(s) its decode peers have not pulled yet"
                   in worker.proc.output(), timeout=15, what="the drain's progress line")
        assert worker.proc.proc.poll() is None
        os.kill(worker.proc.pid, signal.SIGINT)
        assert worker.proc.proc.wait(timeout=15) == 1  # not after the abort timeout
    finally:
        worker.stop()
    assert "stopping now, before the drain is over; what it still waited for ends with an error: the KV of 1" \
        in worker.proc.output()
