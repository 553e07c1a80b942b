"""SIGTERM while a request streams: the stream ends with an error event, then [DONE], not a cut connection."""
from __future__ import annotations

import json
import os
import signal

import httpx

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
