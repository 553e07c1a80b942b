"""Registers one worker record in etcd and keeps it alive until SIGTERM/SIGINT.

    python -m neuron_connector.register_demo --etcd 127.0.0.1:2379 --role prefill \
        --host 127.0.0.1 --http-port 8100 --kv-port 14579 --ttl 2
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading

from common.roles import DEFAULT_KV_PORT, ROLES
from neuron_connector import Registration, WorkerRecord


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--kv-host", default=None, help="defaults to --host")
    parser.add_argument("--kv-port", type=int, default=DEFAULT_KV_PORT)
    parser.add_argument("--engine-id", default=None)
    parser.add_argument("--model", default="")
    parser.add_argument("--ttl", type=int, default=10, help="lease TTL in seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)

    record = WorkerRecord(role=args.role, host=args.host, http_port=args.http_port,
                          kv_host=args.kv_host or args.host, kv_port=args.kv_port,
                          engine_id=args.engine_id or f"{args.role}-{args.host}-{args.http_port}",
                          model=args.model)
    registration = Registration(args.etcd, record, ttl=args.ttl)
    registration.start()
    print(f"registered {record.key} lease={registration.lease_id}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    registration.stop()
    print(f"unregistered {record.key}", flush=True)


if __name__ == "__main__":
    main()
