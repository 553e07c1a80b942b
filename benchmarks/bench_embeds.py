"""Image-embeddings transfer throughput, against this machine's own limits in the same run.

`embeds-<backend>`: the rows of one image part pushed by the transfer engine from an encode-side
region of rows (worker/multimodal/rows.py) into a prefill-side region in another process, as a pull
from an encode worker moves them. `fetch-<backend>`: the whole pull a prefill worker makes from a
real encode worker (`python -m worker --role encode`): the HTTP ask, the push, the copy out of
the region and the digest check; the part is encoded before the clock starts. The ceilings:
`memcpy` (single thread, for shm) and `raw_tcp` (one loopback stream into another process, for tcp),
both from benchmarks/bench_transfer.py. Rows are the built-in model's (hidden 256, float32).

    python -m benchmarks.bench_embeds --quick --json embeds.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import safetensors.torch
import torch

from benchmarks.bench_transfer import MIB, Memcpy, RawTcp, measure, print_table, ratio
from stack.serving import Process, free_port, wait_healthy
from worker.multimodal.fetch import EmbedsFetcher
from worker.multimodal.ref import EmbedsRef
from worker.multimodal.rows import RowRegion
from worker.model.loader import builtin_model_path, load_config

HIDDEN = load_config(builtin_model_path()).hidden_size
ROW_BYTES = HIDDEN * 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["shm", "tcp"], choices=["shm", "tcp"])
    parser.add_argument("--quick", action="store_true", help="4 and 16 MiB parts, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    args.sizes = [4, 16] if args.quick else [4, 16, 64]
    args.repeats = args.repeats or (3 if args.quick else 5)
    return args


def _rows(size: int) -> int:
    return size * MIB // ROW_BYTES


def _receiver(backend: str, capacity: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    region = RowRegion(backend, "127.0.0.1", HIDDEN, torch.float32, capacity)
    rows = region.reserve(capacity).rows   # every push lands from row 0
    conn.send(region.descriptor())
    while (n := conn.recv()) is not None:  # the first n rows, for checking
        conn.send(rows[:n].clone())
    region.close()


class EmbedsSession:
    """Pushes the rows of one part from our region into a region of another process."""

    def __init__(self, backend: str, largest: int) -> None:
        self.name = f"embeds-{backend}"
        capacity = _rows(largest)
        self._conn, theirs = mp.Pipe()
        self._proc = mp.get_context("spawn").Process(target=_receiver, args=(backend, capacity, theirs))
        self._proc.start()
        self._region = RowRegion(backend, "127.0.0.1", HIDDEN, torch.float32, capacity)
        self._slot = self._region.reserve(capacity)
        self._slot.rows.copy_(torch.randn(capacity, HIDDEN))
        self._peer = self._conn.recv()

    def run(self, size: int) -> None:
        n = _rows(size)
        slot = type(self._slot)(self._slot.first, self._region.blocks_for(n), self._slot.rows[:n])
        self._region.push(slot, self._peer, 0, timeout=120).wait(130)

    def check(self, size: int) -> None:
        n = min(_rows(size), 64)
        self._conn.send(n)
        if not torch.equal(self._conn.recv(), self._slot.rows[:n]):
            raise SystemExit(f"{self.name}: the rows that arrived differ from the rows sent")

    def close(self) -> None:
        self._conn.send(None)
        self._region.close()
        self._proc.join(30)
        self._proc.kill()


class FetchSession:
    """A real encode worker; each run is one prefill-side fetch of a part encoded before the clock starts."""

    def __init__(self, backend: str, largest: int) -> None:
        self.name = f"fetch-{backend}"
        self._dir = tempfile.TemporaryDirectory(prefix="bench-embeds-")
        port = free_port()
        mb = str(2 * largest + 8)
        self._worker = Process(f"encode worker ({backend})", [
            "-m", "worker", "--role", "encode", "--port", str(port), "--kv-transport", backend,
            "--allowed-local-media-path", self._dir.name, "--embeds-region-mb", mb, "--max-file-size-mb", mb])
        self._url = f"http://127.0.0.1:{port}"
        wait_healthy(f"{self._url}/health", [self._worker], 120)
        self._loop = asyncio.new_event_loop()
        self._fetcher = self._loop.run_until_complete(self._make(backend, mb))
        self._ready: EmbedsRef | None = None

    async def _make(self, backend: str, mb: str) -> EmbedsFetcher:
        return EmbedsFetcher(RowRegion(backend, "127.0.0.1", HIDDEN, torch.float32, int(mb) * MIB // ROW_BYTES))

    def prepare(self, size: int) -> None:
        path = Path(self._dir.name) / f"part{size}.safetensors"
        if not path.exists():
            safetensors.torch.save_file({"embeddings": torch.randn(_rows(size), HIDDEN)}, path)
        reply = httpx.post(f"{self._url}/v1/encode", json={"parts": [{"url": path.name}]}, timeout=120)
        if reply.status_code != 200:
            raise SystemExit(f"{self.name}: encoding a {size} MiB part failed: {reply.text[:300]}")
        self._ready = EmbedsRef.from_dict(reply.json()["parts"][0], "bench")

    def run(self, size: int) -> None:
        assert self._ready is not None
        self._loop.run_until_complete(self._fetcher.fetch(self._ready, "bench"))
        self._ready = None

    def close(self) -> None:
        self._loop.run_until_complete(self._fetcher.aclose())
        self._loop.close()
        self._worker.stop()
        self._dir.cleanup()


def run_group(makers: list[Any], sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    sessions: list[Any] = []
    try:
        for make in makers:
            sessions.append(make())
        return measure(sessions, sizes, repeats)
    finally:
        for session in sessions:
            session.close()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    top = max(args.sizes)
    nbytes = top * MIB
    groups: list[list[Any]] = []
    for backend in args.backends:
        ceiling = (lambda: Memcpy(nbytes)) if backend == "shm" else (lambda: RawTcp(nbytes))
        groups.append([ceiling, lambda b=backend: EmbedsSession(b, top), lambda b=backend: FetchSession(b, top)])
    results: dict[str, dict[int, float]] = {}
    for group in groups:
        results.update(run_group(group, args.sizes, args.repeats))
    print(f"embedding rows of hidden {HIDDEN}, float32 ({ROW_BYTES} B a row); median of {args.repeats}")
    print_table(results, args.sizes)
    ratios = {"embeds_shm_over_memcpy": ratio(results, "embeds-shm", "memcpy", top),
              "embeds_tcp_over_raw_tcp": ratio(results, "embeds-tcp", "raw_tcp", top),
              "fetch_shm_over_memcpy": ratio(results, "fetch-shm", "memcpy", top),
              "fetch_tcp_over_raw_tcp": ratio(results, "fetch-tcp", "raw_tcp", top)}
    print(f"ratios at {top} MiB: " + ", ".join(f"{k}={v}" for k, v in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps({
            "hidden_size": HIDDEN, "dtype": "float32", "sizes_mib": args.sizes, "repeats": args.repeats,
            "gbps": {name: {str(s): round(v, 3) for s, v in row.items()} for name, row in results.items()},
            "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
