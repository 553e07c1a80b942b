"""The worker's command line for the global prefill queue (kept free of heavy imports), and its side of the
queue, which follows the role it serves."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from common.prefill_job import nats_url

if TYPE_CHECKING:
    from worker.server.prefill_puller import PrefillPuller
    from worker.server.queued_prefill import QueuedPrefills

DEFAULT_MAX_JOBS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("global prefill queue (roles prefill and decode)")
    group.add_argument("--prefill-queue", metavar="nats://HOST:PORT", default=None,
                       help="role prefill: pull prefill jobs from this NATS JetStream queue (filled by the proxy's "
                            "--prefill-queue) while this worker has room; role decode: put the prefill legs of "
                            "decode_first requests on it (default: off, prefill legs go over HTTP only)")
    group.add_argument("--prefill-queue-max-jobs", type=int, default=DEFAULT_MAX_JOBS, metavar="N",
                       help="room: pull a job only while this worker's jobs and engine requests are fewer than N "
                            f"(default {DEFAULT_MAX_JOBS})")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits with a message for a bad value; normalises the URL."""
    if args.prefill_queue_max_jobs < 1:
        parser.error(f"--prefill-queue-max-jobs must be at least 1, got {args.prefill_queue_max_jobs}")
    if args.prefill_queue is None:
        return
    if args.role not in ("prefill", "decode"):
        parser.error("--prefill-queue is for role prefill or decode")
    try:
        args.prefill_queue = nats_url(args.prefill_queue)
    except ValueError as exc:
        parser.error(f"--prefill-queue: {exc}")


class QueueSide:
    """The worker's side of the queue for the role it serves, to start and stop: a prefill worker's puller, or
    the requester a decode worker puts decode_first's prefill legs on the queue through. `follow` moves it to
    the worker's new role after a change of role (worker/server/role_flip.py)."""

    def __init__(self, worker: Any, args: argparse.Namespace) -> None:
        self._worker, self._args = worker, args
        self.role: str = args.role
        self._side = _side(worker, args, self.role)

    def start(self) -> None:
        self._side.start()

    async def stop(self) -> None:
        await self._side.stop()

    async def follow(self, role: str) -> None:
        """The side of `role`, started, in place of the old role's (which the change of role drained)."""
        if role == self.role:
            return
        await self._side.stop()
        self.role, self._side = role, _side(self._worker, self._args, role)
        self._side.start()


def _side(worker: Any, args: argparse.Namespace, role: str) -> PrefillPuller | QueuedPrefills:
    """The side of `role`, set on the app state `worker` (the other role's cleared)."""
    from worker.server.prefill_puller import worker_puller
    from worker.server.queued_prefill import QueuedPrefills

    worker.queued_prefills = worker.prefill_puller = None
    if role == "decode":
        worker.queued_prefills = QueuedPrefills(args.prefill_queue)
        return worker.queued_prefills
    worker.prefill_puller = worker_puller(worker, args.prefill_queue, args.host, args.port, args.prefill_queue_max_jobs)
    return worker.prefill_puller
