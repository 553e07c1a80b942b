"""The vLLM 1P1D commands of docs/vllm.md ("Serving with vLLM"), built here so that a script can run them as a
user would; tests/benchmarks/test_readme_vllm.py checks that page shows exactly these."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from stack.vllm import DI_PREFILL_ARGS

# What docs/vllm.md says to set on a host other work shares (see "Serving with vLLM"): vLLM's CPU build
# otherwise sizes each server's KV cache to most of the host's memory, and a second server cannot start;
# and a prefill there may take far longer than the default 30 s the decode server's pull waits.
KV_SPACE_GIB = "2"
SHARED_HOST_ENV = {"prefill": {"VLLM_CPU_KVCACHE_SPACE": KV_SPACE_GIB}, "decode": {"VLLM_CPU_KVCACHE_SPACE": KV_SPACE_GIB}}
SHARED_HOST_EXTRA = {"prefill": {}, "decode": {"pull_timeout": 120}}


@dataclass(frozen=True, slots=True)
class ReadmePorts:
    """The ports docs/vllm.md shows (its defaults), or free ones for a run."""

    proxy: int = 8000
    prefill: int = 8100
    decode: int = 8200
    kv: int = 14579
    prefill_status: int = 8101
    decode_status: int = 8201


def kv_config(role: str, ports: ReadmePorts, shared_host: bool = True) -> dict[str, Any]:
    extra: dict[str, Any] = ({"kv_port": ports.kv, "status_port": ports.prefill_status} if role == "prefill"
                             else {"status_port": ports.decode_status})
    if shared_host:
        extra.update(SHARED_HOST_EXTRA[role])
    return {"kv_connector": "NeuronConnector", "kv_connector_module_path": "neuron_connector.vllm",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer", "kv_connector_extra_config": extra}


def readme_commands(model: str, ports: ReadmePorts = ReadmePorts(),
                    shared_host: bool = True) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, environment) of the prefill server, the decode server and the proxy, in start order."""
    servers = [(role, ["vllm", "serve", model, "--port", str(getattr(ports, role)),
                       *(DI_PREFILL_ARGS if role == "prefill" else ()), "--kv-transfer-config",
                       json.dumps(kv_config(role, ports, shared_host), separators=(", ", ": "))],
                SHARED_HOST_ENV[role] if shared_host else {}) for role in ("prefill", "decode")]
    proxy = ["python", "proxy_server.py", "--port", str(ports.proxy), "--prefill-ip", "127.0.0.1",
             "--prefill-port", str(ports.prefill), "--prefill-kv-port", str(ports.kv), "--decode-ip", "127.0.0.1",
             "--decode-port", str(ports.decode), "--decode-status-port", str(ports.decode_status)]
    return [*servers, ("proxy", proxy, {})]


def shell_lines(model: str = "MODEL", ports: ReadmePorts = ReadmePorts()) -> list[str]:
    """The commands as docs/vllm.md shows them: one shell line each, environment first."""
    return [" ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(argv)])
            for _, argv, env in readme_commands(model, ports)]
