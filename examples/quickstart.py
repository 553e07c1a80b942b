"""Quickstart: start a worker on the built-in model, ask it for a completion and a chat answer, stop it.

    python examples/quickstart.py [--model PATH] [--max-tokens 32]

The worker runs as a subprocess (`python -m worker --role both`) on a free port on 127.0.0.1 and
is always stopped on the way out, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Worker:
    """A worker subprocess in its own process group, logging to a temp file."""

    def __init__(self, port: int, model: str | None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="worker-", suffix=".log", delete=False)
        args = [sys.executable, "-m", "worker", "--role", "both", "--port", str(port)]
        if model:
            args += ["--model", model]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the worker was not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self.log.close()
        os.unlink(self.log.name)


def sse_bodies(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def show(title: str, text: str, usage: dict | None = None) -> None:
    print(f"\n=== {title}")
    print(text.strip() or "(empty)")
    if usage:
        print(f"--- tokens: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion")


def run_requests(client: httpx.Client, max_tokens: int) -> None:
    prompt = "The three primary colors are"
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0}).raise_for_status().json()
    show(f"completion: {prompt!r}", prompt + body["choices"][0]["text"], body["usage"])

    print(f"\n=== streamed completion: {prompt!r}\n{prompt}", end="", flush=True)
    with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0, "stream": True}) as r:
        for chunk in sse_bodies(r.raise_for_status()):
            print(chunk["choices"][0]["text"], end="", flush=True)
    print()

    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                     "temperature": 0}).raise_for_status().json()
    show("chat: " + messages[0]["content"], body["choices"][0]["message"]["content"], body["usage"])

    print("\n=== streamed chat (with usage)")
    usage = None
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        for chunk in sse_bodies(r.raise_for_status()):
            if chunk["choices"]:
                print(chunk["choices"][0]["delta"].get("content", ""), end="", flush=True)
            usage = chunk.get("usage") or usage
    print(f"\n--- tokens: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args()
    worker = Worker(free_port(), args.model)
    try:
        print(f"starting a worker (pid {worker.proc.pid}) on {worker.url} ...", flush=True)
        worker.wait_ready(args.startup_timeout)
        models = httpx.get(f"{worker.url}/v1/models", timeout=10).json()["data"]
        print(f"serving {models[0]['id']} (context {models[0]['max_model_len']} tokens)")
        with httpx.Client(base_url=worker.url, timeout=300) as client:
            run_requests(client, args.max_tokens)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"quickstart failed: {exc}", file=sys.stderr)
        return 1
    finally:
        worker.stop()
        print("worker stopped")


if __name__ == "__main__":
    sys.exit(main())
