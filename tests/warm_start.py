"""Python children of the tests, forked from a server that has imported torch, the worker and the proxy once.

A cold `python -m worker` spends about 2.7 s of its 3.3 s start importing, a proxy about 1.1 s; the suite
starts about a hundred workers, sixty proxies and fifty fake workers. For the whole session (tests/conftest.py)
`Process` starts the commands of `WARM_MODULES` and `WARM_SCRIPTS`, unpinned and without a launcher prefix,
from multiprocessing's fork server instead, with `tests/warm_start_imports.py` preloaded: the same command
line runs in a fresh process of its own session, logging to the same file; a worker is ready in about 0.6 s.
The code that runs is unchanged; only the imports are shared. Every other command starts cold, and so do the
processes examples and launchers start themselves, so that path stays tested.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys

from stack.serving import ROOT, Child, Process

WARM_MODULES = ("worker", "planner", "tests.proxy.fake_worker")   # python -m MODULE
WARM_SCRIPTS = ("proxy_server.py",)                                 # python SCRIPT
COLD_START = Process._start

_FORK_SERVER = multiprocessing.get_context("forkserver")
_FORK_SERVER.set_forkserver_preload(["tests.warm_start_imports", __name__])


class ForkedChild:
    """A child of the fork server seen as the `subprocess.Popen` that `Process` expects."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self._process.exitcode


def start(process: Process, argv: list[str], env: dict[str, str]) -> Child:
    """`Process._start` for the session: forked warm where the command is one of ours, else started cold."""
    warm = (argv[0] == sys.executable and process.core is None and not process.prefix and len(argv) > 1 and (
        argv[1] in WARM_SCRIPTS or (argv[1] == "-m" and len(argv) > 2 and argv[2] in WARM_MODULES)))
    if not warm:
        return COLD_START(process, argv, env)
    # Daemonic: should a test leak one, the fork server's client stops it when pytest exits.
    child = _FORK_SERVER.Process(target=run, args=(argv[1:], env, process.log.name), name=process.name, daemon=True)
    child.start()
    return ForkedChild(child)


def run(args: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked child: become what `python ARGS` would be (`-m MODULE ...` or `SCRIPT ...`), then run it."""
    os.setsid()  # its own session, as `Process` starts every child, so signals reach all of it
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    try:
        if args[0] == "-m":
            sys.argv = args[1:]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            runpy.run_path(str(ROOT / args[0]), run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # the fork server's child ends with os._exit: no interpreter exit runs them
