"""A static xPyD stack: prefill and decode workers that publish KV cache events, behind one proxy."""
from __future__ import annotations

import json

from stack.serving import Stack, StackOptions, free_port, start_proxy, started, wait_healthy, worker_args


def events_config(port: int, host: str = "127.0.0.1") -> str:
    """The --kv-events-config (vLLM's JSON) of a worker publishing on `host`:`port` (vLLM binds only a
    wildcard host, `*`: on any other it connects to a subscriber that binds)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{host}:{port}"})


def start_xpyd(options: StackOptions, num_prefill: int, num_decode: int) -> Stack:
    """`num_prefill` prefill then `num_decode` decode workers, each on options.cores[i % len(cores)] and with
    its KV events on, and the proxy (options.proxy_extra picks its routing) over them as static workers."""
    def build(stack: Stack) -> None:
        backends, ports = [], []
        for i, role in enumerate(["prefill"] * num_prefill + ["decode"] * num_decode):
            port, kv_port = free_port(), free_port() if role == "prefill" else None
            name = f"{role} worker {i if role == 'prefill' else i - num_prefill}"
            args = [*worker_args(role, port, options, kv_port), "--kv-events-config", events_config(free_port())]
            stack.start(name, args, options.cores[i % len(options.cores)])
            stack.worker_urls[name] = f"http://127.0.0.1:{port}"
            backends.append(f"--{role}=127.0.0.1:{port}" + (f":{kv_port}" if kv_port else ""))
            ports.append(port)
        for port in ports:
            wait_healthy(f"http://127.0.0.1:{port}/health", stack.processes, options.startup_timeout_s)
        start_proxy(stack, backends, options)

    return started(build)
