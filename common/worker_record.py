"""The record a worker registers in etcd (neuron_connector.registry) and shows in its GET /health answer,
and the proxy reads back (proxy.discovery, proxy.workers)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from common.errors import RegistrationError
from common.roles import DEFAULT_KV_PORT, WORKER_ROLES

# How the proxy drives a worker: "neuron" = our signal plane (both legs at once, decode pulls
# the KV), "nixl" = vLLM's upstream NixlConnector handoff (prefill first, its answer to decode).
KV_PROTOCOLS = ("neuron", "nixl")
# Which server a worker is: our `python -m worker`, or `vllm serve` with NeuronConnector ("" unknown: a
# static worker that shows no record, which is `vllm serve`). A vLLM decode worker samples the first
# token again itself.
OUR_SERVER, VLLM_SERVER = "neuron-di", "vllm"
KEY_PREFIX = "/workers/"


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
    status_port: int = 0     # where GET /timeline answers if not on the HTTP API (vLLM's); 0 = the HTTP API
    server: str = ""         # OUR_SERVER, VLLM_SERVER or "" (unknown)
    kv_secret_id: str = ""
    dtype: str = ""
    kv_events: str = ""      # tcp://HOST:PORT where it publishes KV cache events (common/kv_events.py); "" none

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
                       kv_protocol=obj.get("kv_protocol", "neuron"), status_port=int(obj.get("status_port") or 0),
                       server=str(obj.get("server") or ""), kv_secret_id=str(obj.get("kv_secret_id") or ""),
                       dtype=str(obj.get("dtype") or ""), kv_events=str(obj.get("kv_events") or ""))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RegistrationError(f"malformed worker record {obj!r}: {exc}") from exc
