"""`python -m planner`: sets how many prefill and decode workers run, through a connector, until SIGTERM.

    python -m planner --etcd 127.0.0.1:2379 --proxy-url http://127.0.0.1:8000 \\
        --ttft-target-ms 2000 --itl-target-ms 100 --budget 8 --connector local \\
        --worker-command "python -m worker --role {role} --port {port} --kv-port {kv_port} --etcd {etcd}"
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Sequence

from planner.config import PlannerConfig
from planner.connectors import Connector
from planner.connectors.flip import RoleFlipper
from planner.connectors.kubernetes import KubernetesConnector
from planner.connectors.local import LocalConnector, check_template
from planner.errors import ConfigError, PlannerError
from planner.fleet import EtcdWorkers
from planner.loop import Planner
from planner.observe import Observer

log = logging.getLogger("planner")
CONNECTORS = ("local", "flip", "kubernetes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m planner", description=__doc__.splitlines()[0])
    where = parser.add_argument_group("where the fleet is")
    where.add_argument("--etcd", required=True, help="host:port of the etcd the workers register in")
    where.add_argument("--proxy-url", required=True, help="the proxy whose /metrics give TTFT and ITL")
    slo = parser.add_argument_group("targets and bounds")
    slo.add_argument("--ttft-target-ms", type=float, required=True, help="time to first token to keep under")
    slo.add_argument("--itl-target-ms", type=float, required=True, help="inter-token latency to keep under")
    slo.add_argument("--percentile", type=float, default=0.9, help="of TTFT and ITL held to the targets (default 0.9)")
    slo.add_argument("--budget", type=int, required=True, help="most workers, prefill and decode together")
    for role in ("prefill", "decode"):
        slo.add_argument(f"--min-{role}", type=int, default=1, help=f"fewest {role} workers (default 1)")
        slo.add_argument(f"--max-{role}", type=int, default=None, help=f"most {role} workers (default: the budget)")
    rules = parser.add_argument_group("the decision's rules")
    rules.add_argument("--interval", type=float, default=5.0, help="seconds between decisions (default 5)")
    rules.add_argument("--window", type=float, default=None,
                       help="seconds of metrics each decision reads, smoothing short intervals (default 3 intervals)")
    rules.add_argument("--cooldown", type=float, default=20.0, help="seconds after a change with no other (default 20)")
    rules.add_argument("--min-samples", type=int, default=10,
                       help="requests an interval must have seen before it may scale up (default 10)")
    rules.add_argument("--scale-down-after", type=int, default=3,
                       help="intervals in a row a role must be under --utilization-down to shrink (default 3)")
    rules.add_argument("--utilization-up", type=float, default=0.8)
    rules.add_argument("--utilization-target", type=float, default=0.65)
    rules.add_argument("--utilization-down", type=float, default=0.45)
    rules.add_argument("--max-batch", type=int, default=16, help="the decode workers' --max-num-seqs (default 16)")
    rules.add_argument("--prefill-tokens-per-s", type=float, default=1856.0,
                       help="prefill speed of one worker until measured")
    rules.add_argument("--decode-base-ms", type=float, default=9.4, help="decode step time at batch 0 (profile)")
    rules.add_argument("--decode-per-seq-ms", type=float, default=0.55, help="decode step time per sequence (profile)")
    act = parser.add_argument_group("connector")
    act.add_argument("--connector", choices=CONNECTORS, default="local",
                     help="local: worker processes on this host (and role flips of ours); flip: role flips only, "
                          "a fixed fleet of our workers; kubernetes: the Deployments' replicas")
    act.add_argument("--worker-command", default=None,
                     help="local: the command line of a new worker, with {role} {port} {kv_port} {etcd}")
    act.add_argument("--no-role-flip", action="store_true", help="local: start and stop only (e.g. vllm serve)")
    act.add_argument("--start-timeout", type=float, default=120.0,
                     help="local: seconds a new worker has to register in etcd (default 120)")
    act.add_argument("--flip-timeout", type=float, default=120.0,
                     help="seconds a role flip may take, the worker's drain included (default 120)")
    act.add_argument("--namespace", default="default", help="kubernetes: the Deployments' namespace")
    act.add_argument("--prefill-deployment", default="neuron-di-prefill")
    act.add_argument("--decode-deployment", default="neuron-di-decode")
    act.add_argument("--state-file", type=Path, default=None,
                     help="keeps the planner's memory (cool-down, changes under way) across restarts")
    act.add_argument("--decisions", type=Path, default=None, help="appends every interval's decision (JSON lines)")
    return parser


def config_from(args: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(
        ttft_target_s=args.ttft_target_ms / 1000, itl_target_s=args.itl_target_ms / 1000, budget=args.budget,
        min_prefill=args.min_prefill, max_prefill=args.max_prefill, min_decode=args.min_decode,
        max_decode=args.max_decode, interval_s=args.interval, cooldown_s=args.cooldown,
        min_samples=args.min_samples, scale_down_after=args.scale_down_after, percentile=args.percentile,
        utilization_up=args.utilization_up, utilization_target=args.utilization_target,
        utilization_down=args.utilization_down, max_batch=args.max_batch,
        prefill_tokens_per_s=args.prefill_tokens_per_s, decode_base_s=args.decode_base_ms / 1000,
        decode_per_seq_s=args.decode_per_seq_ms / 1000)


def connector_from(args: argparse.Namespace, etcd: EtcdWorkers) -> Connector:
    flipper = RoleFlipper(etcd, args.flip_timeout)
    if args.connector == "flip":
        return flipper
    if args.connector == "kubernetes":
        return KubernetesConnector(etcd, args.namespace, {"prefill": args.prefill_deployment,
                                                          "decode": args.decode_deployment})
    return LocalConnector(etcd, args.worker_command, args.budget, args.start_timeout,
                          None if args.no_role_flip else flipper)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, PlannerConfig]:
    """Everything checked up front: a bad value exits with status 2, naming its flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from(args)
        EtcdWorkers(args.etcd)
        if not args.proxy_url.startswith(("http://", "https://")):
            raise ConfigError(f"--proxy-url must be an http(s) URL, got {args.proxy_url!r}")
        if args.connector == "local":
            if args.worker_command is None:
                raise ConfigError("--connector local needs --worker-command")
            check_template(args.worker_command)
    except PlannerError as exc:
        parser.error(str(exc))
    return args, config


async def run(args: argparse.Namespace, config: PlannerConfig) -> None:
    etcd = EtcdWorkers(args.etcd)
    connector = connector_from(args, etcd)
    window = args.window if args.window is not None else 3 * config.interval_s
    observer = Observer(args.proxy_url, config.percentile, max_age_s=window + 3 * config.interval_s + 5,
                        window_s=window)
    planner = Planner(config, connector, observer, args.state_file, args.decisions)
    task = asyncio.create_task(planner.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    log.info("planning %s..%s prefill and %s..%s decode workers within a budget of %d, TTFT p%g <= %g ms, "
             "ITL <= %g ms, through the %s connector", config.min_prefill, config.bounds("prefill")[1],
             config.min_decode, config.bounds("decode")[1], config.budget, config.percentile * 100,
             config.ttft_target_s * 1000, config.itl_target_s * 1000, args.connector)
    try:
        await task
    except asyncio.CancelledError:
        log.info("stopping; the workers run on")
    finally:
        await observer.close()
        await connector.close()


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)   # a line per metrics read would bury the decisions
    try:
        asyncio.run(run(args, config))
    except PlannerError as exc:
        log.error("planner failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
