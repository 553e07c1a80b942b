"""Many workers started at once, each on ports picked beforehand with `free_port`.

A picked port is only free when it is picked: while dozens of workers start (tens of seconds on two
cores), an outgoing connection of any process can be given it first, and the worker then exits with
"Address already in use". Such a worker is started again on new ports; any other failure stops them all.
"""
from __future__ import annotations

from typing import Callable, Sequence

from stack.serving import Process, StackError, free_port, port_was_taken, wait_healthy

# (index, http port, kv port) -> the worker's name and its command line after `python`
WorkerArgs = Callable[[int, int, int], tuple[str, Sequence[str]]]


def start_workers(count: int, make_args: WorkerArgs, timeout_s: float = 180.0,
                  attempts: int = 3) -> list[tuple[Process, str]]:
    """Starts `count` workers together and waits until each answers GET /health: [(process, URL)].
    A worker whose port was taken before it bound it is started again on new ports, `attempts` times in all."""
    workers = [_start(i, make_args) for i in range(count)]
    try:
        for i in range(count):
            for attempt in range(1, attempts + 1):
                process, url = workers[i]
                try:
                    wait_healthy(f"{url}/health", [process], timeout_s)
                    break
                except StackError as exc:
                    if not port_was_taken(exc) or attempt == attempts:
                        raise
                    process.stop()
                    workers[i] = _start(i, make_args)
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: Sequence[tuple[Process, str]], timeout_s: float = 10.0) -> None:
    for process, _ in reversed(workers):
        process.stop(timeout_s=timeout_s)


def _start(index: int, make_args: WorkerArgs) -> tuple[Process, str]:
    port = free_port()
    name, args = make_args(index, port, free_port())
    return Process(name, args), f"http://127.0.0.1:{port}"
