"""When a prefill worker may pull jobs from the global prefill queue, and how many: pure, plain numbers in.

A worker pulls only while it has room, so that jobs wait in the stream (where any worker with room takes
them) rather than on a busy worker. Its room is `max_jobs` less what it already carries: the jobs it took
and has not finished, or its engine's requests (running and waiting) if that is more (prefill legs that came
over HTTP share the engine). A draining worker takes nothing.
"""
from __future__ import annotations


def prefill_room(max_jobs: int, jobs_in_flight: int, engine_requests: int, draining: bool = False) -> int:
    """How many jobs to pull now: 0 to `max_jobs`."""
    if max_jobs < 1:
        raise ValueError(f"max_jobs must be at least 1, got {max_jobs}")
    if draining:
        return 0
    return max(0, max_jobs - max(jobs_in_flight, engine_requests, 0))
