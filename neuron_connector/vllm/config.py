"""NeuronConnector's settings, read from vLLM's `--kv-transfer-config` (checked, never guessed)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from common.roles import DEFAULT_KV_PORT

# vLLM's kv_role -> our worker role.
ROLE_OF_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode"}
TRANSPORTS = ("auto", "shm", "tcp", "nixl", "neuron")


@dataclass(frozen=True, slots=True)
class NeuronConnectorConfig:
    """Where this worker's signal plane listens, how it moves KV, and where it registers.

    `kv_connector_extra_config` keys are the field names below (all optional, but
    `http_port` when `etcd` is given: the proxy must know where this `vllm serve` answers).
    """

    role: str
    kv_host: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT       # prefill's ROUTER; 0 = a free port
    kv_transport: str = "auto"
    engine_id: str = ""                  # signal-plane id; "" = the transfer engine's transfer_id
    etcd: str = ""                       # host:port; "" = static (no registration)
    etcd_ttl: int = 10
    http_host: str = ""                  # registered address; "" = kv_host
    http_port: int = 0
    model: str = ""                      # registered model name; "" = vLLM's served model name
    abort_timeout: float = 60.0          # prefill: free published blocks nobody pulled by then
    pull_timeout: float = 30.0           # decode: fail a pull not done by then
    kv_integrity_check: bool = True      # decode: verify every pull with a CRC-32C the prefill sends
    kv_secret_file: str = ""             # the shared KV secret (mode 600); "" = $NEURON_DI_KV_SECRET_FILE or none
    idle_wait: float = 0.02              # a step that runs nothing waits this long for a transfer to end
    status_port: int = 0                 # GET /timeline and /metrics of the connector on kv_host; 0 = a free port, -1 = off
    kv_events: str = ""                  # registered KV events endpoint; "" = the one vLLM's --kv-events-config binds

    def __post_init__(self) -> None:
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {self.kv_transport!r}")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be a TCP port (0 = any free one), got {self.kv_port}")
        if not -1 <= self.status_port < 65536:
            raise ValueError(f"status_port must be a TCP port (0 = any free one, -1 = none), got {self.status_port}")
        if self.etcd and not 0 < self.http_port < 65536:
            raise ValueError("kv_connector_extra_config.http_port (this server's --port) is required "
                             "with etcd, so that the proxy can reach this worker")
        for name in ("abort_timeout", "pull_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.idle_wait <= 1:
            raise ValueError(f"idle_wait must be in [0, 1] s, got {self.idle_wait}")
        if self.etcd_ttl < 1:
            raise ValueError(f"etcd_ttl must be >= 1 s, got {self.etcd_ttl}")

    @classmethod
    def from_vllm(cls, kv_role: str, extra: dict[str, Any] | None) -> NeuronConnectorConfig:
        """From vLLM's kv_role and kv_connector_extra_config; ValueError names what is wrong."""
        role = ROLE_OF_KV_ROLE.get(kv_role)
        if role is None:
            raise ValueError(f"NeuronConnector needs kv_role kv_producer (prefill) or kv_consumer (decode), "
                             f"not {kv_role!r}")
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls) if f.name != "role"}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        for name, value in extra.items():
            kind = type(known[name].default)
            if (isinstance(value, bool) and kind is not bool) or not isinstance(
                    value, (int, float) if kind is float else kind):
                raise ValueError(f"kv_connector_extra_config.{name} must be {kind.__name__}, got {value!r}")
        return cls(role=role, **extra)
