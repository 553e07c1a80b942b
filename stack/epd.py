"""Starting an EPD stack: an encode, a prefill and a decode worker behind the proxy (`--encode`),
plus, to compare with, one `both` worker that loads the same image files itself.

Every worker may read image files under `media_dir` (--allowed-local-media-path). Built on
stack/serving.py: every process is stopped on the way out, every wait has a deadline.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from stack.serving import (Stack, StackOptions, free_port, start_proxy, started, wait_healthy,
                                    worker_args)

ROLES = ("encode", "prefill", "decode", "both")


def start_epd(options: StackOptions, media_dir: Path, proxy_extra: tuple[str, ...] = ()) -> Stack:
    """The stack; `worker_urls` names each worker by its role, `url` is the proxy's."""
    options = replace(options, worker_extra=("--allowed-local-media-path", str(media_dir), *options.worker_extra))

    def build(stack: Stack) -> None:
        ports = {role: free_port() for role in ROLES}
        kv_port = free_port()
        for i, role in enumerate(ROLES):
            args = worker_args(role, ports[role], options, kv_port if role == "prefill" else None)
            stack.start(role, args, options.cores[i % 2])
            stack.worker_urls[role] = f"http://127.0.0.1:{ports[role]}"
        for url in stack.worker_urls.values():
            wait_healthy(f"{url}/health", stack.processes, options.startup_timeout_s)
        start_proxy(stack, ["--prefill", f"127.0.0.1:{ports['prefill']}", "--decode", f"127.0.0.1:{ports['decode']}",
                            "--encode", f"127.0.0.1:{ports['encode']}", *proxy_extra], options)

    return started(build)
