"""This worker's record: shown in its GET /health answer and, with --etcd, registered in etcd under a lease.

A drain leaves etcd for good; a change of role leaves, then publishes the record of the new role.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from common.worker_record import WorkerRecord
from neuron_connector import Registration


class Registrar:
    """Publishes the record `make_record(engine)` gives for the running engine; `leave()` revokes it."""

    def __init__(self, make_record: Callable[[Any], WorkerRecord], etcd: str | None = None, ttl: int = 10) -> None:
        self.make_record = make_record
        self.etcd, self.ttl = etcd, ttl
        self.record: WorkerRecord | None = None
        self._registration: Registration | None = None
        self._lock = threading.Lock()   # leave() runs on executor threads: a drain's and a role change's

    async def publish(self, engine: Any) -> None:
        """Shows the engine's record and registers it (RegistrationError if etcd does not answer)."""
        self.record = self.make_record(engine)
        if self.etcd is None:
            return
        registration = Registration(self.etcd, self.record, ttl=self.ttl)
        await asyncio.get_running_loop().run_in_executor(None, registration.start)
        with self._lock:
            self._registration = registration

    def leave(self) -> bool:
        """Revokes the registration, if any (blocking; the key is gone at once); whether there was one."""
        with self._lock:
            registration, self._registration = self._registration, None
        if registration is not None:
            registration.stop()
        return registration is not None
