"""Test helpers for the worker server: an in-process server."""
from __future__ import annotations

import asyncio
import threading

from hypercorn.asyncio import serve
from quart import Quart

from stack.serving import free_port, wait_healthy
from worker.server.cli import hypercorn_config

class InProcessServer:
    """Serves a Quart app with hypercorn on a free port, on an event loop in a background thread."""

    def __init__(self, app: Quart) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, args=(app,), daemon=True)
        self._thread.start()
        wait_healthy(f"{self.url}/health", timeout_s=120.0)

    def _run(self, app: Quart) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(serve(app, hypercorn_config("127.0.0.1", self.port),
                                            shutdown_trigger=self._stop.wait))

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "in-process server did not shut down"
        self._loop.close()
