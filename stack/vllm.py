"""Starting `vllm serve` stacks on this machine's cores: colocated, 1P1D with NeuronConnector,
1P1D with vLLM's NixlConnector, each behind our proxy. The vLLM flags live here and nowhere else.

vLLM runs from this interpreter (`python -m vllm.entrypoints.cli.main serve`); each server
is pinned to one core, its OpenMP threads bound to that core, and stopped on the way out.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from common.roles import DEFAULT_KV_PORT
from stack.serving import Stack, StackOptions, free_port, start_proxy, started, wait_healthy

SERVED_NAME = "model"
# A DI prefill server's token budget a step (vLLM's CPU default is 2048): prompts that arrive together finish
# one after another instead of all at the end of one long step, as our worker's default does (docs/vllm.md).
DI_PREFILL_ARGS = ("--max-num-batched-tokens", "512")


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What every vLLM server of a stack shares."""

    model: str
    cores: tuple[int, int] = (0, 1)
    max_model_len: int = 2048
    num_blocks: int = 256                  # KV blocks of 128 tokens per server
    kv_transport: str = "auto"             # NeuronConnector's transport
    extra_config: dict[str, Any] = field(default_factory=dict)   # more NeuronConnector settings
    extra_args: tuple[str, ...] = ()       # more `vllm serve` flags for every server
    proxy_extra: tuple[str, ...] = ()      # more flags for our proxy
    startup_timeout_s: float = 300.0
    dtype: str = "float32"                 # vLLM's --dtype
    env: dict[str, str] = field(default_factory=dict)   # more environment for every server


def serve_args(options: VllmOptions, port: int, kv_config: dict[str, Any] | None = None,
               extra: Sequence[str] = ()) -> list[str]:
    """vLLM's defaults (chunked prefill on) and `extra`, a DI server with `kv_config` as its --kv-transfer-config."""
    args = ["-m", "vllm.entrypoints.cli.main", "serve", options.model, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", options.dtype,
            "--max-model-len", str(options.max_model_len), "--num-gpu-blocks-override", str(options.num_blocks),
            "--uvicorn-log-level", "warning", *extra, *options.extra_args]
    if kv_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    return args


def neuron_kv_config(role: str, options: VllmOptions, kv_port: int = DEFAULT_KV_PORT,
                     etcd: str | None = None, http_port: int = 0, status_port: int = 0) -> dict[str, Any]:
    """NeuronConnector for `role` prefill or decode; with `etcd`, registered there under `http_port`;
    its status server (GET /timeline) on `status_port` (0: a free one)."""
    extra = {"kv_transport": options.kv_transport, "kv_port": kv_port, "status_port": status_port,
             **options.extra_config}
    if etcd:
        extra.update(etcd=etcd, http_port=http_port)
    return {"kv_connector": "NeuronConnector", "kv_connector_module_path": "neuron_connector.vllm",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer", "kv_connector_extra_config": extra}


def nixl_kv_config() -> dict[str, Any]:
    """vLLM's own NixlConnector over host memory (the only way it runs without a GPU)."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def start_server(stack: Stack, name: str, options: VllmOptions, port: int, core: int,
                 kv_config: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 extra: Sequence[str] = ()) -> None:
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core), "HF_HUB_OFFLINE": "1",
                **options.env, **(env or {})}
    stack.start(name, serve_args(options, port, kv_config, extra), core, vllm_env)
    stack.worker_urls[name] = f"http://127.0.0.1:{port}"


def wait_servers(stack: Stack, options: VllmOptions) -> None:
    for url in stack.worker_urls.values():
        wait_healthy(f"{url}/health", stack.processes, options.startup_timeout_s)


def _proxy(stack: Stack, options: VllmOptions, args: list[str]) -> None:
    start_proxy(stack, args, StackOptions(startup_timeout_s=options.startup_timeout_s, proxy_extra=options.proxy_extra))


def start_colocated(options: VllmOptions, proxied: bool = False) -> Stack:
    """One plain `vllm serve` on the first core (the baseline a user runs today)."""
    def build(stack: Stack) -> None:
        port = free_port()
        start_server(stack, "vllm", options, port, options.cores[0])
        wait_servers(stack, options)
        stack.url = stack.worker_urls["vllm"]
        if proxied:
            _proxy(stack, options, ["--mode", "colocated", "--worker", f"127.0.0.1:{port}"])

    return started(build)


def start_colocated_pair(options: VllmOptions) -> Stack:
    """Two plain `vllm serve` replicas, one per core, behind our proxy round-robining them (what a
    vLLM user runs today on these cores)."""
    def build(stack: Stack) -> None:
        ports = [free_port() for _ in options.cores]
        for i, (port, core) in enumerate(zip(ports, options.cores)):
            start_server(stack, f"vllm {i}", options, port, core)
        wait_servers(stack, options)
        _proxy(stack, options, ["--mode", "colocated", *[a for p in ports for a in ("--worker", f"127.0.0.1:{p}")]])

    return started(build)


def start_neuron_1p1d(options: VllmOptions, etcd: str | None = None) -> Stack:
    """Prefill and decode `vllm serve` with NeuronConnector, one core each, behind our proxy
    (which finds them in etcd when `etcd` is given, else from its command line)."""
    def build(stack: Stack) -> None:
        prefill, decode, kv_port = free_port(), free_port(), free_port()
        status = {"prefill": free_port(), "decode": free_port()}
        start_server(stack, "prefill", options, prefill, options.cores[0],
                     neuron_kv_config("prefill", options, kv_port, etcd, prefill, status["prefill"]),
                     extra=DI_PREFILL_ARGS)
        start_server(stack, "decode", options, decode, options.cores[1],
                     neuron_kv_config("decode", options, etcd=etcd, http_port=decode, status_port=status["decode"]))
        stack.kv_ports["prefill"] = kv_port
        stack.status_urls = {name: f"http://127.0.0.1:{port}" for name, port in status.items()}
        wait_servers(stack, options)
        # `vllm serve` shows no record on GET /health (our worker does): the proxy needs the KV port.
        _proxy(stack, options, ["--etcd", etcd] if etcd else [
            "--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill), "--prefill-kv-port", str(kv_port),
            "--decode-ip", "127.0.0.1", "--decode-port", str(decode)])

    return started(build)


def start_nixl_1p1d(options: VllmOptions) -> Stack:
    """Prefill and decode `vllm serve` with NixlConnector, one core each, behind our proxy
    driving vLLM's own handoff (`--kv-protocol nixl`)."""
    def build(stack: Stack) -> None:
        prefill, decode = free_port(), free_port()
        for name, port, core in (("prefill", prefill, options.cores[0]), ("decode", decode, options.cores[1])):
            start_server(stack, name, options, port, core, nixl_kv_config(),
                         {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
        wait_servers(stack, options)
        _proxy(stack, options, ["--kv-protocol", "nixl", "--prefill-ip", "127.0.0.1", "--prefill-port",
                                str(prefill), "--decode-ip", "127.0.0.1", "--decode-port", str(decode)])

    return started(build)
