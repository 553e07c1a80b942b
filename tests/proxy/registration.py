"""Registering a test worker in etcd under a lease, as the real workers do."""
from __future__ import annotations

import asyncio

import aetcd

from proxy.workers import WorkerRecord


async def register_forever(etcd: str, role: str, host: str, port: int, kv_port: int, model: str,
                           ttl: int = 2) -> None:
    """Puts the worker's record under a `ttl`-second lease and keeps the lease alive until killed."""
    etcd_host, etcd_port = etcd.split(":")
    record = WorkerRecord(role, host, port, kv_port=kv_port, model=model, transfer={"backend": "fake"})
    async with aetcd.Client(etcd_host, int(etcd_port)) as client:
        lease = await client.lease(ttl)
        await client.put(record.key.encode(), record.to_json(), lease=lease)
        while True:
            await asyncio.sleep(ttl / 4)
            await lease.refresh()
