"""A prefill side in its own process: a real engine with a seeded pool and a SendBuffer.

    python -m tests.neuron_connector.prefill_proc --port 0 --backend shm --seed 1 \
        --publish r1:3,7:42 [--head-dim 16]

Prints `READY <port>` once serving and `RELEASED <id>` per release; runs until SIGTERM.
"""
from __future__ import annotations

import argparse
import signal
import threading

import torch

from neuron_connector import SendBuffer
from tests.neuron_connector.kv import engine_with_pool, layout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--backend", default="shm")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--engine-id", default="prefill-proc")
    parser.add_argument("--publish", action="append", default=[], help="id:block,block:token")
    args = parser.parse_args()
    torch.set_num_threads(1)

    kv_layout = layout(head_dim=args.head_dim)
    engine, _ = engine_with_pool(args.backend, kv_layout, seed=args.seed)
    send = SendBuffer(engine, kv_layout, args.engine_id, "127.0.0.1", args.port,
                      on_release=lambda rid: print(f"RELEASED {rid}", flush=True))
    send.start()
    for item in args.publish:
        rid, blocks, token = item.split(":")
        send.publish(rid, [int(b) for b in blocks.split(",")], int(token))
    print(f"READY {send.port}", flush=True)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    send.close()
    engine.close()


if __name__ == "__main__":
    main()
