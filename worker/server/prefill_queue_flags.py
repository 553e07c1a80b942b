"""The worker's command line for the global prefill queue (kept free of heavy imports)."""
from __future__ import annotations

import argparse

from common.prefill_job import nats_url

DEFAULT_MAX_JOBS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("global prefill queue (role prefill)")
    group.add_argument("--prefill-queue", metavar="nats://HOST:PORT", default=None,
                       help="pull prefill jobs from the NATS JetStream queue the proxy (--prefill-queue) fills, "
                            "while this worker has room (default: off, prefill legs come over HTTP only)")
    group.add_argument("--prefill-queue-max-jobs", type=int, default=DEFAULT_MAX_JOBS, metavar="N",
                       help="room: pull a job only while this worker's jobs and engine requests are fewer than N "
                            f"(default {DEFAULT_MAX_JOBS})")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits with a message for a bad value; normalises the URL."""
    if args.prefill_queue_max_jobs < 1:
        parser.error(f"--prefill-queue-max-jobs must be at least 1, got {args.prefill_queue_max_jobs}")
    if args.prefill_queue is None:
        return
    if args.role != "prefill":
        parser.error("--prefill-queue is for role prefill")
    try:
        args.prefill_queue = nats_url(args.prefill_queue)
    except ValueError as exc:
        parser.error(f"--prefill-queue: {exc}")
