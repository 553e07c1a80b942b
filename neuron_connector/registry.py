"""etcd registration of a worker under a lease (the proxy reads the records back in proxy.discovery).

Key `/workers/{role}/{host}/{http_port}`, value a `WorkerRecord` as JSON. The lease is kept
alive by a private asyncio loop in a daemon thread (the engine is not async); stopping
revokes it (the key vanishes at once), a killed process's key vanishes when the lease
expires. If etcd goes away for a while the keep-alive retries and, once etcd answers
again, registers anew under a fresh lease if the old one expired meanwhile.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Coroutine, TypeVar

import aetcd

from common.roles import DEFAULT_KV_PORT, WORKER_ROLES
from neuron_connector.errors import RegistrationError

log = logging.getLogger(__name__)
T = TypeVar("T")

# How the proxy drives a worker: "neuron" = our signal plane (both legs at once, decode pulls
# the KV), "nixl" = vLLM's upstream NixlConnector handoff (prefill first, its answer to decode).
KV_PROTOCOLS = ("neuron", "nixl")
KEY_PREFIX = "/workers/"
_CALL_TIMEOUT_S = 3


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One worker: where its HTTP API and its KV signal plane listen, and how it is driven.

    The workers register it in etcd and the proxy reads it back (or builds it from its command
    line for static workers, where the KV host defaults to the HTTP host, and completes it from
    the record our worker shows in its GET /health answer). `engine_id` is the id the worker's
    signal plane shows in its handshake: a worker registers it; a static one that shows no
    record has "" (unknown, so nobody checks it). `kv_protocol` is one of KV_PROTOCOLS.
    `kv_secret_id` is common.kv_secret.secret_id of the worker's KV secret ("" unknown), so the proxy
    sees a prefill and a decode worker that cannot authenticate to each other; `dtype` the one the worker
    computes in (what image embeddings sent to it must be; "" unknown). Bad fields raise ValueError.
    """

    role: str
    host: str
    http_port: int
    kv_host: str = ""
    kv_port: int = DEFAULT_KV_PORT
    engine_id: str = ""
    model: str = ""
    transfer: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    kv_protocol: str = "neuron"
    kv_secret_id: str = ""
    dtype: str = ""

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"worker role must be one of {WORKER_ROLES}, got {self.role!r}")
        if self.kv_protocol not in KV_PROTOCOLS:
            raise ValueError(f"worker kv_protocol must be one of {KV_PROTOCOLS}, got {self.kv_protocol!r}")
        if not self.host or not 0 < self.http_port < 65536:
            raise ValueError(f"bad worker address {self.host!r}:{self.http_port}")
        if not self.kv_host:
            object.__setattr__(self, "kv_host", self.host)

    @property
    def key(self) -> str:
        return f"{KEY_PREFIX}{self.role}/{self.host}/{self.http_port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON object: the value in etcd, and `worker` in a worker's GET /health answer."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> WorkerRecord:
        """Parses a record; RegistrationError when it is not one (missing optional fields default)."""
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise RegistrationError(f"malformed worker record {data!r}: {exc}") from exc
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: Any) -> WorkerRecord:
        """The record a JSON object holds; RegistrationError when it holds none."""
        try:
            return cls(role=obj["role"], host=obj["host"], http_port=int(obj["http_port"]),
                       kv_host=obj.get("kv_host") or "", kv_port=int(obj.get("kv_port", DEFAULT_KV_PORT)),
                       engine_id=obj.get("engine_id") or "", model=str(obj.get("model") or ""),
                       transfer=dict(obj.get("transfer") or {}),
                       kv_protocol=obj.get("kv_protocol", "neuron"), kv_secret_id=str(obj.get("kv_secret_id") or ""),
                       dtype=str(obj.get("dtype") or ""))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RegistrationError(f"malformed worker record {obj!r}: {exc}") from exc


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
