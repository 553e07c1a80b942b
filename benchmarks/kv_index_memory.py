"""The proxy's KV index memory per cached block: one worker's index filled with a million blocks.

    python -m benchmarks.kv_index_memory --blocks 1000000 --json benchmarks/results/kv_index_memory.json

Blocks arrive as BlockStored events of 64 chained 16-token blocks (engine hashes: 64-bit ints, as our
worker sends), measured with tracemalloc; then BlockRemoved of all of them, and a cap of half. The fill's
speed is timed on a second index with tracemalloc off (it slows every allocation several times).
"""
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Sequence

from benchmarks.bench_cli import write_json
from common.kv_events import BlockRemoved, BlockStored, EventBatch
from proxy.kv_index import WorkerKVIndex

BLOCK, RUN = 16, 64


def fill(index: WorkerKVIndex, num_blocks: int) -> list[int]:
    hashes = []
    for seq, start in enumerate(range(0, num_blocks, RUN)):
        n = min(RUN, num_blocks - start)
        ids = tuple(range(start + 1, start + n + 1))
        tokens = tuple((start * BLOCK + i) % 50_000 for i in range(n * BLOCK))
        index.apply(EventBatch(seq, 0.0, (BlockStored(ids, None if start % 4096 == 0 else start, tokens, BLOCK),)))
        hashes.extend(ids)
    return hashes


def measure(num_blocks: int) -> dict[str, Any]:
    tracemalloc.start()
    index = WorkerKVIndex(capacity=num_blocks)
    base = tracemalloc.get_traced_memory()[0]
    hashes = fill(index, num_blocks)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    index.apply(EventBatch(index.next_seq or 0, 0.0, (BlockRemoved(tuple(hashes)),)))
    after_remove = len(index)
    timed = WorkerKVIndex(capacity=num_blocks)
    t0 = time.perf_counter()
    fill(timed, num_blocks)
    fill_s = time.perf_counter() - t0
    del timed
    capped = WorkerKVIndex(capacity=num_blocks // 2)
    fill(capped, num_blocks)
    return {"blocks": num_blocks, "bytes": held, "bytes_per_block": held / num_blocks,
            "fill_s": fill_s, "blocks_per_s": num_blocks / fill_s, "blocks_after_remove_all": after_remove,
            "blocks_with_cap_of_half": len(capped)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_index_memory", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out = measure(args.blocks)
    out["command"] = "python -m benchmarks.kv_index_memory " + " ".join(sys.argv[1:] if argv is None else argv)
    for key, value in out.items():
        print(f"{key:<26}{value:,.1f}" if isinstance(value, float) else f"{key:<26}{value}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
