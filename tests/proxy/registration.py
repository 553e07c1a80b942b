"""Registering a test worker in etcd under a lease, as the real workers do."""
from __future__ import annotations

import asyncio

import aetcd

from proxy.workers import WorkerRecord


async def register_forever(etcd: str, role: str, host: str, port: int, kv_port: int, model: str,
                           ttl: int = 2) -> None:
    """Puts the worker's record under a `ttl`-second lease and keeps it alive until killed.

    The worker goes on serving while etcd is away, and registers again when it is back.
    """
    etcd_host, etcd_port = etcd.split(":")
    record = WorkerRecord(role, host, port, kv_port=kv_port, model=model, transfer={"backend": "fake"})
    registered = False
    async with aetcd.Client(etcd_host, int(etcd_port), timeout=2) as client:
        while True:
            try:
                if not registered:
                    lease = await client.lease(ttl)
                    await client.put(record.key.encode(), record.to_json(), lease=lease)
                    registered = True
                registered = (await lease.refresh()).TTL > 0
            except aetcd.ClientError:
                registered = False
            await asyncio.sleep(ttl / 4)
