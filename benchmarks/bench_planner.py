"""Phase-change benchmark: the planner against every static prefill/decode split of the same budget.

    python -m benchmarks.bench_planner [--quick] [--json PATH] [--workers N] [--phase-seconds S] ...

A fleet of simulated workers (`python -m worker --engine mock`, one per budget slot) runs behind the proxy
over etcd. The trace (benchmarks/phase_change.py: chat, documents, generations, chat again, quiet) is
replayed against every static split (set by role flips, phases of --static-phase-seconds, the quiet phase
left out), then against the planner (`python -m planner --connector local`: role flips, and workers
drained or started within the budget) starting from an even split. Per phase: SLO attainment (TTFT and
TPOT), the planner's changes (and those after it recovered), seconds to recover (every later 5 s window
at >= 90%). JSON and a PNG of attainment and the P/D counts over time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.phase_change import (CUT, PHASES, TPOT_TARGET_S, TTFT_TARGET_S, attainment_by_phase, recovery_s,
                                     request_rows, rolling_attainment, trace)
from benchmarks.phase_report import format_table, plot, summarize
from benchmarks.planner_fleet import MockFleet, replay
from benchmarks.serving_metrics import RequestResult
from planner.fleet import EtcdWorkers
from proxy.flows import STRATEGIES
from stack.serving import Process

STATIC_PHASES = 4   # the quiet phase tells nothing about a static split


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 workers, short phases, three static splits")
    parser.add_argument("--json", type=Path, help="write the results here (and the PNG beside it)")
    parser.add_argument("--workers", type=int, default=None, help="the budget: simulated workers (default 12)")
    parser.add_argument("--phase-seconds", type=float, default=None, help="each phase of the planner's run (default 60)")
    parser.add_argument("--static-phase-seconds", type=float, default=None,
                        help="each phase of a static split's run (default: --phase-seconds; shorter phases than a "
                             "long generation lasts never let a static split reach the phase's steady state)")
    parser.add_argument("--static-splits", default=None,
                        help="prefill counts of the static splits, comma separated (default: every split)")
    parser.add_argument("--statics-from", type=Path, default=None,
                        help="take the static splits' results from this earlier run's JSON (same budget, static "
                             "phase length and seed) instead of running them again: the planner alone is run")
    parser.add_argument("--grace-seconds", type=float, default=10.0,
                        help="after the last arrival, before what still runs is cut and judged as it stands")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routing", choices=("least_loaded", "round_robin"), default="least_loaded",
                        help="the proxy's --routing (default least_loaded: the workers a flip adds to a role take its "
                             "new requests until they are as busy as the rest)")
    parser.add_argument("--prefill-queue", action=argparse.BooleanOptionalAction, default=False,
                        help="prefill legs wait in the global prefill queue (a nats-server the benchmark starts), "
                             "each worker taking one at a time, so a worker that turns prefill takes the oldest")
    parser.add_argument("--move-streams", action=argparse.BooleanOptionalAction, default=False,
                        help="a worker that changes role hands its running streams back and the proxy resumes them "
                             "on another decode worker (--drain-hands-back-streams, --resume-streams), so a flip "
                             "to prefill need not wait for them to finish")
    parser.add_argument("--flow", choices=STRATEGIES, default="prefill_first",
                        help="the proxy's --disaggregation-strategy (default %(default)s: a decode leg reaches its "
                             "worker only once its prompt's KV is ready, so a decode worker that changes role to "
                             "prefill waits for its running streams alone, not for legs whose prefill is queued)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.workers = args.workers or (6 if quick else 12)
    args.phase_seconds = args.phase_seconds or (15.0 if quick else 60.0)
    args.static_phase_seconds = args.static_phase_seconds or args.phase_seconds
    splits = args.static_splits or (f"1,{args.workers // 2},{args.workers - 1}" if quick else
                                    ",".join(str(p) for p in range(1, args.workers)))
    args.static_splits = [int(p) for p in splits.split(",")]
    if args.workers < 2 or any(not 0 < p < args.workers for p in args.static_splits):
        parser.error(f"--workers must be at least 2 and every static split between 1 and {args.workers - 1}")
    return args


def planner_args(fleet: MockFleet, args: argparse.Namespace, decisions: Path) -> list[str]:
    """The planner's command line: the SLO, the budget, and the simulated engine's profile (its decode step
    intercept 130 ms: the engine's 100 ms plus what passes between steps and through the proxy here). Time
    runs fast here (2 s intervals, a 6 s window): the sample guard's default of 10 first tokens a window held
    back every needed step in runs of it (a saturated role delays the first tokens), so it is 1."""
    return ["-m", "planner", "--etcd", fleet.etcd.endpoint, "--proxy-url", fleet.proxy_url,
            "--ttft-target-ms", str(TTFT_TARGET_S * 1000), "--itl-target-ms", str(TPOT_TARGET_S * 1000),
            "--budget", str(args.workers), "--connector", "local", "--worker-command", fleet.worker_template(),
            "--interval", "2", "--cooldown", "8", "--min-samples", "1", "--scale-down-after", "5",
            "--utilization-down", "0.3", "--prefill-tokens-per-s", "1500", "--decode-base-ms", "130",
            "--decode-per-seq-ms", "10", "--decisions", str(decisions)]


def run_static(fleet: MockFleet, prefill: int, args: argparse.Namespace) -> dict[str, Any]:
    fleet.set_split(prefill)
    arrivals = trace(PHASES[:STATIC_PHASES], args.static_phase_seconds, args.workers, args.seed)
    results = asyncio.run(replay(fleet.proxy_url, arrivals, args.grace_seconds))
    shares = attainment_by_phase(arrivals, results, STATIC_PHASES, seconds=args.static_phase_seconds)
    print(f"  static {prefill}P{args.workers - prefill}D: " + "  ".join(
        f"{p.name} {s:.0%}" if s is not None else f"{p.name} -" for p, s in zip(PHASES, shares)), flush=True)
    return {"prefill": prefill, "decode": args.workers - prefill, "attainment_by_phase": shares,
            "requests": len(arrivals), **outcomes(results)}


def earlier_statics(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The static splits of an earlier run's report, checked to be of the trace this run would replay (its
    recorded command read with this parser); each keeps that run's command and load."""
    report = json.loads(path.read_text())
    made = parse_args(report["run"]["command"].split()[3:])
    same = ("workers", "static_phase_seconds", "seed", "grace_seconds", "routing", "prefill_queue", "move_streams",
            "flow")
    if any(getattr(made, key) != getattr(args, key) for key in same):
        raise SystemExit(f"{path} ran another trace: " + ", ".join(
            f"{key} {getattr(made, key)} (here {getattr(args, key)})" for key in same))
    return [{**s, "run": s.get("run", report["run"])} for s in report["static"]]


def run_planner(fleet: MockFleet, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    fleet.set_split(args.workers // 2)
    decisions = workdir / "planner_decisions.jsonl"
    decisions.unlink(missing_ok=True)
    planner = Process("planner", planner_args(fleet, args, decisions))
    try:
        _first_decision(planner, decisions)
        arrivals = trace(PHASES, args.phase_seconds, args.workers, args.seed)
        started = time.time()
        results = asyncio.run(replay(fleet.proxy_url, arrivals, args.grace_seconds))
    finally:
        planner.stop()
        log = planner.output()
    lines = [json.loads(line) for line in decisions.read_text().splitlines()] if decisions.exists() else []
    timeline = [{"t": round(d["at"] - started, 2), "prefill": d["prefill"], "decode": d["decode"],
                 "changed": d["changed"], "reason": d["reason"]} for d in lines]
    seconds = args.phase_seconds
    recovery = [recovery_s(arrivals, results, i, seconds) for i in range(len(PHASES))]
    changes, after_settle = [], []
    for i in range(len(PHASES)):
        times = [d["t"] for d in timeline if d["changed"] and i * seconds <= d["t"] < (i + 1) * seconds]
        settled = i * seconds + (recovery[i] if recovery[i] is not None else seconds)
        changes.append(len(times))
        after_settle.append(sum(t >= settled for t in times))
    ours = {url for _, url in fleet.workers}
    started = [r.base_url for r in asyncio.run(EtcdWorkers(fleet.etcd.endpoint).read()) if r.base_url not in ours]
    fleet.drain_registered(started)   # the workers the planner started leave as it would stop them
    return {"attainment_by_phase": attainment_by_phase(arrivals, results, len(PHASES), seconds=seconds),
            "rolling_attainment": rolling_attainment(arrivals, results, 5.0, len(PHASES) * seconds),
            "changes_by_phase": changes, "changes_after_settle_by_phase": after_settle,
            "recovery_s_by_phase": recovery, "timeline": timeline, "requests": len(arrivals), **outcomes(results),
            "per_request": request_rows(arrivals, results),
            "flip_failures": [line for line in log.splitlines() if "flip of" in line and not line.endswith(": done")],
            "log": log}


def _first_decision(planner: Process, decisions: Path, timeout_s: float = 60.0) -> None:
    """Waits for the planner's first read of the fleet, so the trace starts with it: a planner started
    earlier would read the idle fleet before the load and shrink it on that."""
    deadline = time.monotonic() + timeout_s
    while not (decisions.exists() and decisions.read_text()):
        planner.check_alive()
        if time.monotonic() > deadline:
            raise SystemExit(f"the planner made no decision within {timeout_s:g} s:\n{planner.output()[-2000:]}")
        time.sleep(0.1)


def outcomes(results: list[RequestResult]) -> dict[str, Any]:
    """Requests that failed (by error) and those still running when the run was cut."""
    errors = Counter(r.error for r in results if r.error not in (None, CUT))
    return {"failed": sum(errors.values()), "errors": dict(errors), "cut": sum(r.error == CUT for r in results)}


def main() -> None:
    args = parse_args()
    workdir = args.json.parent if args.json else Path(tempfile.gettempdir())
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"phase-change benchmark: {args.workers} simulated workers; SLO TTFT <= {TTFT_TARGET_S:g} s, "
          f"TPOT <= {TPOT_TARGET_S * 1000:g} ms", flush=True)
    earlier = earlier_statics(args.statics_from, args) if args.statics_from else None
    load_before = os.getloadavg()
    fleet = MockFleet(args.workers, args.routing, args.prefill_queue, args.move_streams, args.flow)
    try:
        statics = earlier or [run_static(fleet, p, args) for p in args.static_splits]
        planner = run_planner(fleet, args, workdir)
    finally:
        fleet.close()
    report = summarize(args, statics, planner)
    report["run"] = {"command": " ".join(["python -m benchmarks.bench_planner", *sys.argv[1:]]),
                     "load_average_1_5_15_before": load_before, "load_average_1_5_15_after": os.getloadavg(),
                     "cpus": os.cpu_count()}
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        note = plot(report, args.json.with_suffix(".png"))
        if note:
            print(note)


if __name__ == "__main__":
    main()
