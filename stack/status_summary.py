"""Prints a one-screen summary of a proxy's GET /status every N seconds (the launchers' `--status N`).

    python -m stack.status_summary --url http://127.0.0.1:8000 --every 10

One block per round: each worker by role (health, legs in flight, KV usage, running/waiting), the prefill
queue's depth, the answers by status and the recent phase percentiles. A proxy that does not answer is said
so, and the next round tries again; Ctrl-C or SIGTERM stops it.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

import httpx

_PHASES = ("prefill_answer", "handoff", "decode_first", "first_token", "request")


def summary(status: dict[str, Any], now: str) -> str:
    """The text of one round, from a GET /status body."""
    lines = [f"-- neuron-di status {now} " + "-" * 40]
    for role, workers in status.get("workers", {}).items():
        if not workers:
            lines.append(f"{role:8} none")
        for worker in workers:
            lines.append(f"{role:8} {worker['address']:21} {_state(worker):9} in flight {worker['in_flight']:3}  "
                         + _load(worker))
    requests = ", ".join(f"{n} x {status_code}" for status_code, n in status.get("requests", {}).items()) or "none"
    lines.append(f"prefill queue {status.get('prefill_queue_depth', 0)}   answers {requests}")
    phases = status.get("phases", {})
    if phases:
        lines.append(f"{'phase (ms)':16}{'p50':>9}{'p90':>9}{'p99':>9}{'n':>7}")
        for phase in (p for p in _PHASES if p in phases):
            figures = phases[phase]
            lines.append(f"{phase:16}" + "".join(f"{figures[q] * 1000:9.1f}" for q in ("p50", "p90", "p99"))
                         + f"{figures['count']:7}")
    return "\n".join(lines)


def _state(worker: dict[str, Any]) -> str:
    if worker.get("draining"):
        return "draining"
    return "healthy" if worker.get("healthy") else "DOWN"


def _load(worker: dict[str, Any]) -> str:
    load = worker.get("load")
    if load is None:
        return f"load unknown ({worker.get('load_error', 'no answer')})"
    parts = []
    if "kv_usage" in load:
        parts.append(f"KV {load['kv_usage'] * 100:5.1f}%")
    for key in ("running", "waiting", "transferring"):
        if key in load:
            parts.append(f"{key} {int(load[key])}")
    if load.get("kv_held_oldest_seconds"):
        parts.append(f"oldest held {load['kv_held_oldest_seconds']:.1f}s")
    return "  ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the proxy's base URL")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between two summaries")
    parser.add_argument("--rounds", type=int, default=0, help="stop after this many (0: never)")
    args = parser.parse_args(argv)
    if args.every <= 0:
        parser.error("--every must be positive")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    done = 0
    with httpx.Client(timeout=min(10.0, args.every)) as client:
        while args.rounds == 0 or done < args.rounds:
            now = time.strftime("%H:%M:%S")
            try:
                reply = client.get(f"{args.url}/status")
                reply.raise_for_status()
                print(summary(reply.json(), now), flush=True)
            except (httpx.HTTPError, ValueError) as exc:
                print(f"-- neuron-di status {now}: {args.url}/status did not answer ({exc})", flush=True)
            done += 1
            if args.rounds == 0 or done < args.rounds:
                time.sleep(args.every)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(0)
