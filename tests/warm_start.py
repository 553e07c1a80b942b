"""Processes for tests, forked from a server that has imported torch, the worker and the proxy once.

A cold `python -m worker` spends about 2.7 s of its 3.3 s start importing, a proxy about 1.1 s; the suite
starts about a hundred workers and as many proxies and fake workers. `WarmProcess` is a `Process` whose
child is forked from multiprocessing's fork server instead, with `tests/warm_start_imports.py` preloaded:
the same command line (`python -m MODULE ...` or `python SCRIPT ...`) runs in a fresh process of its own
session, logging to the same file; a worker is ready in about 0.6 s. The code that runs is unchanged; only
the imports are shared. Launchers, examples and the README's commands still start everything cold, so
that path stays tested.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys

from stack.serving import ROOT, Child, Process

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


class WarmProcess(Process):
    """A Python `Process` forked warm (see the module's docstring); unpinned, no launcher prefix."""

    def _start(self, argv: list[str], env: dict[str, str]) -> Child:
        if argv[0] != sys.executable or self.core is not None or self.prefix:
            raise ValueError(f"only an unpinned Python command line starts warm, not {argv}")
        # Daemonic: should a test leak one, the fork server's client stops it when pytest exits.
        child = _FORK_SERVER.Process(target=run, args=(argv[1:], env, self.log.name), name=self.name, daemon=True)
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
