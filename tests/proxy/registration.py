"""Test workers in etcd exactly as the real ones: registered with neuron_connector's Registration,
read back with the proxy's own reader."""
from __future__ import annotations

import asyncio

import aetcd

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


def registered_workers(etcd: str, role: str | None = None) -> list[WorkerRecord]:
    """The workers registered in etcd at host:port `etcd` (of `role`, if given), sorted by key."""
    from proxy.discovery import read_workers   # the whole proxy: not for fake workers, which only register

    host, _, port = etcd.rpartition(":")

    async def read() -> list[WorkerRecord]:
        async with aetcd.Client(host, int(port), timeout=3) as client:
            return (await read_workers(client))[0]
    return sorted((w for w in asyncio.run(read()) if role in (None, w.role)), key=lambda w: w.key)
