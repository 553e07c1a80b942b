"""etcd registration of a worker under a lease (the proxy reads the records back in proxy.discovery).

Key `/workers/{role}/{host}/{http_port}`, value a `WorkerRecord` as JSON. The lease is kept
alive by a private asyncio loop in a daemon thread (the engine is not async); stopping
revokes it (the key vanishes at once), a killed process's key vanishes when the lease
expires. If etcd goes away for a while the keep-alive retries and, once etcd answers
again, registers anew under a fresh lease if the old one expired meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from typing import Any, Coroutine, TypeVar

import aetcd

from common.errors import RegistrationError
from common.worker_record import WorkerRecord

log = logging.getLogger(__name__)
T = TypeVar("T")

_CALL_TIMEOUT_S = 3


def _client(endpoint: str) -> aetcd.Client:
    hostport = endpoint.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise RegistrationError(f"etcd endpoint must be host:port, got {endpoint!r}")
    return aetcd.Client(host=host, port=int(port), timeout=_CALL_TIMEOUT_S)


class Registration:
    """Keeps `record` registered in etcd at `endpoint` until `stop()`."""

    def __init__(self, endpoint: str, record: WorkerRecord, ttl: int = 10) -> None:
        if ttl < 1:
            raise ValueError(f"lease TTL must be >= 1 s, got {ttl}")
        self.endpoint, self.record, self.ttl = endpoint, record, ttl
        self.lease_id: int | None = None
        self.registrations = 0            # > 1 after re-registering under a new lease
        self.refreshes = 0                # successful keep-alives
        self.failures = 0                 # keep-alives that could not reach etcd
        self._client = _client(endpoint)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="etcd-keepalive", daemon=True)
        self._keepalive: Future[None] | None = None

    def start(self) -> None:
        """Registers now; RegistrationError if etcd does not answer."""
        self._thread.start()
        try:
            self._call(self._register())
        except RegistrationError:
            self._shutdown()
            raise
        self._keepalive = asyncio.run_coroutine_threadsafe(self._keep_alive(), self._loop)

    def stop(self) -> None:
        """Revokes the lease (the key disappears at once) and stops the thread; idempotent."""
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        if self._keepalive is not None:
            self._loop.call_soon_threadsafe(self._keepalive.cancel)
        try:
            if self.lease_id is not None:
                self._call(self._client.revoke_lease(self.lease_id))
        except RegistrationError as exc:
            log.warning("could not revoke lease %s (the key expires with it): %s", self.lease_id, exc)
        finally:
            self._shutdown()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=_CALL_TIMEOUT_S * 3)
        except aetcd.ClientError as exc:
            raise RegistrationError(f"etcd at {self.endpoint} failed: {exc}") from exc
        except TimeoutError as exc:
            future.cancel()
            raise RegistrationError(f"etcd at {self.endpoint} did not answer in time") from exc

    async def _register(self) -> None:
        try:
            lease = await self._client.lease(self.ttl)
            await self._client.put(self.record.key.encode(), self.record.to_json(), lease=lease)
        except aetcd.ClientError as exc:
            raise RegistrationError(f"cannot register {self.record.key} in etcd at {self.endpoint}: "
                                    f"{exc}") from exc
        self.lease_id = lease.id
        self.registrations += 1

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                reply = await self._client.refresh_lease(self.lease_id)
                if reply is None or reply.TTL <= 0:
                    log.warning("lease of %s expired; registering again", self.record.key)
                    await self._register()
                else:
                    self.refreshes += 1
            except (aetcd.ClientError, RegistrationError) as exc:
                self.failures += 1
                log.warning("etcd keep-alive for %s failed, retrying: %s", self.record.key, exc)

    def _shutdown(self) -> None:
        async def close() -> None:
            await self._client.close()
        try:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=_CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - closing a dead channel must not mask the real error
            log.debug("closing the etcd client: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=_CALL_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()
