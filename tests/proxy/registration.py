"""Registering a test worker in etcd exactly as the real workers do: neuron_connector's Registration."""
from __future__ import annotations

import asyncio

from neuron_connector import Registration, WorkerRecord


async def register_forever(etcd: str, role: str, host: str, port: int, kv_port: int, model: str,
                           ttl: int = 2) -> None:
    """Registers the worker under a `ttl`-second lease, kept alive until the process ends.

    Registration's keep-alive goes on while etcd is away and registers again when it is back.
    """
    record = WorkerRecord(role, host, port, kv_port=kv_port, model=model, transfer={"backend": "fake"})
    registration = Registration(etcd, record, ttl=ttl)
    await asyncio.to_thread(registration.start)
    try:
        await asyncio.Event().wait()
    finally:
        registration.stop()
