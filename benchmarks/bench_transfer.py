"""KV transfer throughput per backend, against this machine's own limits.

Moves the same set of non-contiguous KV blocks (64 MiB, 256 MiB and 1 GiB of 16-token
blocks of the model's layout) from this process into a peer process with each backend,
and in the same run measures the two ceilings they should approach: a single-thread
memcpy between two pre-touched buffers (for shm) and one raw TCP stream on loopback
(for tcp). Each backend also runs with the integrity check, as every pull runs it by
default (`+check`: the receiving process opens its blocks for a handoff and follows them as
they land, summing the CRC-32C of what is in place while the rest is written; the push
reports the CRC-32C of the bytes it sent, summed in the copy's pass over shm and on the
transfer thread otherwise; the receiver sums what is left once the push is done and the two
are compared), next to `crc32c`, the native CRC-32C over the same scattered blocks in one pool. Prints a table; `--json PATH` writes GB/s per backend
and size plus the ratios for the largest size (`checked_over_unchecked_<backend>`);
`--quick` runs 64 and 256 MiB only, in under a minute.

    python -m benchmarks.bench_transfer --quick --json bench.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import queue
import random
import socket
import statistics
import struct
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch

from neuron_connector.protocol import LookupReply
from neuron_connector.verifier import PullVerifier
from transfer import KVLayout, available_backends, create_transfer_engine
from transfer.fences import generations
from transfer.memcopy import NATIVE, crc32c_path
from worker.model.bench_model import BENCH_CONFIG

MIB = 1 << 20
# (layers, kv heads, head dim, dtype) of the KV cache of models we serve.
MODELS = {
    "bench-24m": (BENCH_CONFIG.num_hidden_layers, BENCH_CONFIG.num_key_value_heads,
                  BENCH_CONFIG.head_dim, "float32"),
    "llama-3.1-8b": (32, 8, 128, "bfloat16"),
    "llama-3.2-1b": (16, 8, 64, "bfloat16"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="bench-24m",
                        help="KV layout to move (default: the project's benchmark model)")
    parser.add_argument("--backends", nargs="+", default=None,
                        help="backends to measure (default: shm, tcp and nixl when installed)")
    parser.add_argument("--quick", action="store_true", help="64 and 256 MiB, 3 repeats: under a minute")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--pattern", choices=("random", "contiguous"), default="random",
                        help="random: scattered source and destination blocks (the normal case); "
                             "contiguous: the same ids on both sides, merged into one run")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    args.sizes = [64, 256] if args.quick else [64, 256, 1024]
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.backends = args.backends or [b for b in ("shm", "tcp", "nixl") if b in available_backends()]
    return args


def touched(nbytes: int) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)  # fault every page in now, not during the timed copies
    return buf


class Memcpy:
    """Single-thread memcpy between two pre-touched buffers: the ceiling for shm."""

    name = "memcpy"

    def __init__(self, nbytes: int) -> None:
        self._src, self._dst = touched(nbytes), touched(nbytes)

    def run(self, size: int) -> None:
        ctypes.memmove(self._dst.data_ptr(), self._src.data_ptr(), size * MIB)

    def close(self) -> None:
        del self._src, self._dst


class Crc32c:
    """The native CRC-32C over the scattered blocks of one pool, read in place: what the
    receiving side of a checked pull pays per byte."""

    name = "crc32c"

    def __init__(self, layout: KVLayout, sets: dict[int, tuple[list[int], list[int]]]) -> None:
        self._engine = create_transfer_engine("tcp")
        self._engine.allocate_region(layout)
        self._sets = sets

    def run(self, size: int) -> None:
        self._engine.checksum(self._sets[size][1])

    def close(self) -> None:
        self._engine.close()


def _raw_tcp_receiver(port_out: Connection, nbytes: int) -> None:
    buf = memoryview(touched(nbytes).numpy())
    with socket.create_server(("127.0.0.1", 0)) as server:
        port_out.send(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            while head := conn.recv(8, socket.MSG_WAITALL):
                size, got = struct.unpack("!Q", head)[0], 0
                while got < size:
                    got += conn.recv_into(buf[got:size])
                conn.sendall(b"k")


class RawTcp:
    """One plain TCP stream on loopback into another process, acked: the ceiling for tcp."""

    name = "raw_tcp"

    def __init__(self, nbytes: int) -> None:
        ours, theirs = mp.Pipe()
        self._proc = mp.get_context("spawn").Process(target=_raw_tcp_receiver, args=(theirs, nbytes))
        self._proc.start()
        self._payload = memoryview(touched(nbytes).numpy())
        self._sock = socket.create_connection(("127.0.0.1", ours.recv()))

    def run(self, size: int) -> None:
        self._sock.sendall(struct.pack("!Q", size * MIB))
        self._sock.sendall(self._payload[:size * MIB])
        self._sock.recv(1)

    def close(self) -> None:
        self._sock.close()
        self._proc.join(30)
        self._proc.kill()


def _peer(backend: str, layout: dict[str, Any], conn: Connection) -> None:
    torch.set_num_threads(1)
    engine = create_transfer_engine(backend)
    kv_layout = KVLayout.from_dict(layout)
    pool = engine.allocate_region(kv_layout)
    checked: queue.Queue[int | None] = queue.Queue()
    verifier = PullVerifier(engine, "bench-verify", lambda _address, _reply, local: checked.put(local),
                            kv_layout.block_bytes, follow_min_bytes=0)
    verifier.start()
    conn.send(engine.descriptor())
    while (ask := conn.recv()) is not None:  # ("bytes" | "checksum" | "follow", block ids[, generation])
        what, ids = ask[:2]
        if what == "follow":
            conn.send(_follow(engine, verifier, checked, conn, ids, ask[2]))
        else:
            conn.send(_bytes(pool, ids) if what == "bytes" else engine.checksum(ids))
    verifier.close()
    engine.close()


def _follow(engine: Any, verifier: PullVerifier, checked: queue.Queue[int | None], conn: Connection,
            ids: list[int], generation: int) -> int | None:
    """The receiver of a checked pull, as a decode worker runs it: opens its blocks for the handoff,
    has the integrity check follow them as they land, and hands it the reply when the sender says
    the push is done."""
    fences = engine.fences
    if fences is not None:
        fences.open(ids, generation)
    verifier.watch("bench", ids)
    conn.send("ready")
    conn.recv()
    verifier.verify("bench", LookupReply("bench", True, block_ids_in_peer_device=tuple(ids)))
    crc = checked.get(timeout=60)
    if fences is not None:
        fences.close(ids, generation)
    return crc


def _bytes(pool: torch.Tensor, ids: list[int]) -> bytes:
    return pool[:, :, ids].contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class EngineSession:
    """Our engine pushing block sets into a peer process's pool with one backend."""

    def __init__(self, backend: str, layout: KVLayout, sets: dict[int, tuple[list[int], list[int]]]) -> None:
        self.name = backend
        self._sets = sets
        self._conn, theirs = mp.Pipe()
        self._proc = mp.get_context("spawn").Process(target=_peer, args=(backend, layout.to_dict(), theirs))
        self._proc.start()
        self._engine = create_transfer_engine(backend)
        self._pool = self._engine.allocate_region(layout)
        self._pool.view(-1).view(torch.uint8)[::4093] = 7  # a pattern the peer must end up with
        self._peer = self._engine.connect(self._conn.recv())
        self._generations = generations()

    def run(self, size: int, checked: bool = False) -> None:
        """One push; `checked`: as a pull with the integrity check runs it (neuron_connector)."""
        src, dst = self._sets[size]
        generation = None
        if checked:
            generation = next(self._generations)
            self._conn.send(("follow", dst, generation))
            self._conn.recv()
        token = self._engine.queue_transfer_with_token(self._peer, src, dst, timeout=120, checksum=checked,
                                                       generation=generation)
        token.wait(130)
        if checked:
            self._conn.send("done")
            if self._conn.recv() != token.checksum:
                raise SystemExit(f"{self.name}: the destination's checksum differs from the one sent")

    def check(self, size: int) -> None:
        src, dst = self._sets[size]
        self._conn.send(("bytes", dst[:4]))
        if self._conn.recv() != _bytes(self._pool, src[:4]):
            raise SystemExit(f"{self.name}: destination bytes differ from the source")

    def close(self) -> None:
        self._conn.send(None)
        self._engine.close()
        self._proc.join(30)
        self._proc.kill()


class Checked:
    """An EngineSession's pushes with the integrity check, reported as `<backend>+check`."""

    warm = True   # its session's warm-up run did the first touches

    def __init__(self, session: EngineSession) -> None:
        self.name = f"{session.name}+check"
        self._session = session

    def run(self, size: int) -> None:
        self._session.run(size, checked=True)

    def close(self) -> None:
        pass   # the session is closed on its own


def measure(sessions: list[Any], sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Median GB/s per session and size, the sessions taking turns run by run so that
    load from elsewhere on the machine hits the baseline and the backend alike."""
    rates: dict[str, dict[int, list[float]]] = {s.name: {size: [] for size in sizes} for s in sessions}
    for size in sizes:
        for session in [s for s in sessions if not getattr(s, "warm", False)]:
            _prepare(session, size)
            session.run(size)  # warm-up: connections, first touches
            getattr(session, "check", lambda _: None)(size)
        for _ in range(repeats):
            for session in sessions:
                _prepare(session, size)
                start = time.perf_counter()
                session.run(size)
                rates[session.name][size].append(size * MIB / (time.perf_counter() - start) / 1e9)
    return {name: {size: statistics.median(r) for size, r in row.items()} for name, row in rates.items()}


def _prepare(session: Any, size: int) -> None:
    """The untimed setup of one run, for sessions that have one."""
    getattr(session, "prepare", lambda _: None)(size)


def run_group(makers: list[Callable[[], Any]], sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Runs the sessions `makers` make in turns, each EngineSession also with the integrity check."""
    sessions: list[Any] = []
    try:
        for make in makers:
            sessions.append(make())
        checked = [Checked(s) for s in sessions if isinstance(s, EngineSession)]
        return measure(sessions + checked, sizes, repeats)
    finally:
        for session in sessions:
            session.close()


def block_sets(layout: KVLayout, sizes: list[int], pattern: str) -> dict[int, tuple[list[int], list[int]]]:
    """Source and destination blocks per size, the same for every backend."""
    rng = random.Random(0)
    sets = {}
    for size in sizes:
        count = size * MIB // layout.block_bytes
        if pattern == "contiguous":
            sets[size] = (list(range(count)), list(range(count)))
        else:
            sets[size] = (rng.sample(range(layout.num_blocks), count),
                          rng.sample(range(layout.num_blocks), count))
    return sets


def print_table(results: dict[str, dict[int, float]], sizes: list[int]) -> None:
    print(f"{'GB/s':<12}" + "".join(f"{f'{s} MiB':>12}" for s in sizes))
    for name, row in results.items():
        print(f"{name:<12}" + "".join(f"{row[s]:>12.2f}" for s in sizes))


def ratio(results: dict[str, dict[int, float]], a: str, b: str, size: int) -> float | None:
    if a not in results or b not in results:
        return None
    return round(results[a][size] / results[b][size], 3)


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    layers, heads, head_dim, dtype = MODELS[args.model]
    probe = KVLayout(layers, 1, 16, heads, head_dim, dtype)
    layout = KVLayout(layers, max(args.sizes) * MIB // probe.block_bytes, 16, heads, head_dim, dtype)
    sets = block_sets(layout, args.sizes, args.pattern)
    nbytes = max(args.sizes) * MIB
    engine = lambda name: (lambda: EngineSession(name, layout, sets))  # noqa: E731
    # Each backend runs in turns with the ceiling it is compared to; one group at a time
    # keeps at most four pools of the largest size in memory.
    groups = [[lambda: Memcpy(nbytes), lambda: Crc32c(layout, sets)] + ([engine("shm")] if "shm" in args.backends else []),
              [lambda: RawTcp(nbytes)] + ([engine("tcp")] if "tcp" in args.backends else [])]
    groups += [[engine(b)] for b in args.backends if b not in ("shm", "tcp")]
    results: dict[str, dict[int, float]] = {}
    for group in groups:
        results.update(run_group(group, args.sizes, args.repeats))
    print(f"model {args.model}: {layout.block_bytes // 1024} KiB blocks of 16 tokens, "
          f"{layout.chunk_bytes // 1024} KiB per (layer, k/v) chunk; {args.pattern} blocks; "
          f"median of {args.repeats}; shm copy loop: {'native' if NATIVE else 'Python (no C compiler at install)'}; "
          f"CRC-32C: {crc32c_path() or 'crc32c package'}")
    print_table(results, args.sizes)
    top = max(args.sizes)
    ratios = {"shm_over_memcpy": ratio(results, "shm", "memcpy", top),
              "tcp_over_raw_tcp": ratio(results, "tcp", "raw_tcp", top),
              "shm_over_nixl": ratio(results, "shm", "nixl", top),
              "tcp_over_nixl": ratio(results, "tcp", "nixl", top),
              **{f"checked_over_unchecked_{b}": ratio(results, f"{b}+check", b, top) for b in args.backends}}
    print(f"ratios at {top} MiB: " + ", ".join(f"{k}={v}" for k, v in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps({
            "command": " ".join(["python -m benchmarks.bench_transfer", *sys.argv[1:]]),
            "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg(),
            "model": args.model, "pattern": args.pattern, "layout": layout.to_dict(),
            "block_bytes": layout.block_bytes, "native_copy": NATIVE, "crc32c_path": crc32c_path(),
            "sizes_mib": args.sizes, "repeats": args.repeats, "largest_mib": top,
            "gbps": {name: {str(s): round(v, 3) for s, v in row.items()} for name, row in results.items()},
            "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
