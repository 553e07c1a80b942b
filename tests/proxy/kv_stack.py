"""A `--routing kv` proxy over real workers that publish KV cache events, and a `both` worker beside it."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

from stack.serving import free_port
from stack.xpyd import events_config
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess, start_workers, stop_together


@contextmanager
def kv_routed_stack(num_prefill: int, num_decode: int,
                    worker_extra: Sequence[str] = ()) -> Iterator[tuple[Server, list[WorkerProcess]]]:
    """Prefill then decode workers (each with its KV events and `worker_extra`), then a `both` worker the proxy
    does not know, to compare answers with; the proxy routes by KV. Everything is stopped on the way out."""
    workers: list[WorkerProcess] = []
    proxy: Server | None = None
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    try:
        workers = start_workers(*((role, "shm", ["--kv-events-config", events_config(free_port()), *worker_extra])
                                  for role in roles), ("both", "shm", ()))
        backends = [f"--prefill=127.0.0.1:{w.port}:{w.kv_port}" if w.role == "prefill"
                    else f"--decode=127.0.0.1:{w.port}" for w in workers[:-1]]
        proxy = start_proxy([*backends, "--routing", "kv", "--tokenizer", "builtin", "--health-interval", "0.5"])
        yield proxy, workers
    finally:
        stop_together(proxy.process if proxy is not None else None, *workers)
