"""Fault campaign: real 1P1D and 2P2D stacks, and 1P1D across two hosts, under load, one fault at a
time, uniform checks.

    python -m faults.campaign                    # every scenario, the full load
    python -m faults.campaign --quick            # a small load (a minute or two)
    python -m faults.campaign --scenario kill_decode_1p1d --scenario slow_client_1p1d
    python -m faults.campaign --json benchmarks/results/fault_campaign.json

Scenarios (faults/scenarios.py): SIGKILL of the prefill worker, a decode worker, the proxy
or etcd mid-load, each restarted alone (time to recover measured); clients leaving before the first
byte or mid-stream (time from the last one gone to every KV block free); malformed HTTP and ZMQ
frames under load; slow streaming readers. On two network-namespace hosts joined by a user-space
cable (faults/two_hosts.py; prefill on one, decode and the proxy on the other, KV over tcp):
delay with loss on the cable, and a cut while KV moves (time to recover from clearing it). Each
stack is started once and shared by its scenarios; where namespaces cannot be made (not root),
the two-host scenarios are reported as skipped, with the reason.
Every call has a deadline; a call still open then is hung. Every failure must be a clear error
(OpenAI-style JSON error with its status, or an SSE error event then [DONE]; a cut connection is
one only for clients of a killed proxy), every success must equal the greedy output of one
`--role both` worker, and every KV block of every live worker must be free once the load stops.
Exit status: 0 all of that held (skipped scenarios aside); 1 a stack could not be started; 3 some
check failed.
"""
from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict
import sys
from pathlib import Path
from typing import Any, Callable

from faults.judge import Campaign, ScenarioResult
from faults.load import LoadSize, Reference
from faults.scenarios import SCENARIOS
from faults.stacks import FaultStack, start_1p1d, start_2p2d
from faults.two_hosts import start_two_hosts
from faults.netns_hosts import NetnsUnavailable
from stack.serving import StackError

QUICK = LoadSize(requests=8, concurrency=4, deadline_s=120.0)
FULL = LoadSize(requests=40, concurrency=8, deadline_s=120.0)
STARTERS: dict[str, Callable[[], FaultStack]] = {"1p1d": start_1p1d, "2p2d": start_2p2d,
                                                 "two_hosts": start_two_hosts}
COLUMNS = ("scenario", "sent", "ok", "clear error", "hung", "wrong", "unclear", "blocks leaked", "freed s",
           "recover s", "abandoned free s")


def run_campaign(names: list[str], size: LoadSize, seed: int = 0) -> list[ScenarioResult]:
    """Runs the scenarios `names` in order, one stack per topology, started when first needed."""
    results = []
    with Reference() as reference:
        campaign = Campaign(size, reference, seed)
        for topology, starter in STARTERS.items():
            chosen = [n for n in names if SCENARIOS[n][0] == topology]
            if not chosen:
                continue
            try:
                faults = starter()
            except NetnsUnavailable as exc:
                results += [ScenarioResult(name, topology, skipped=str(exc)) for name in chosen]
                continue
            with faults:
                for name in chosen:
                    print(f"{name} ...", flush=True)
                    results.append(SCENARIOS[name][1](faults, campaign))
    return results


def row(result: ScenarioResult) -> list[str]:
    if result.skipped:
        return [result.name, "skipped", *["-"] * (len(COLUMNS) - 2)]
    t = result.tally
    optional = ["-" if v is None else f"{v:.2f}"
                for v in (result.fault_blocks_free_s, result.recover_s, result.abandoned_free_s)]
    return [result.name, *(str(v) for v in (t.sent, t.ok, t.clear_error, t.hung, t.wrong, t.unclear)),
            str(sum(result.blocks_leaked.values())), *optional]


def format_table(results: list[ScenarioResult]) -> str:
    rows = [list(COLUMNS), *(row(r) for r in results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    for result in results:
        lines += [f"  {result.name}: skipped: {result.skipped}"] if result.skipped else []
        lines += [f"  {result.name}: {problem}" for problem in result.tally.problems]
        lines += [f"  {result.name}: {worker} holds {n} KV blocks after the load stopped"
                  for worker, n in result.blocks_leaked.items() if n]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.requests} requests per load phase, "
                                                             f"not {FULL.requests}")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                        help="run only this scenario (repeat); default every one")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--json", type=Path, help="write the configuration and every result here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    size = QUICK if args.quick else FULL
    names = [n for n in SCENARIOS if not args.scenario or n in args.scenario]
    try:
        results = run_campaign(names, size, args.seed)
    except StackError as exc:
        print(f"fault_campaign: {exc}", file=sys.stderr)
        return 1
    print(format_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {"command": shlex.join(["python", "-m", "faults.campaign", *argv]),
                                  "load": asdict(size),
                                  "seed": args.seed, "scenarios": names}
        args.json.write_text(json.dumps({"config": config, "results": [r.to_json() for r in results]}, indent=1))
    return 0 if all(r.passed for r in results) else 3


if __name__ == "__main__":
    sys.exit(main())
