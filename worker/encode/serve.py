"""`python -m worker --role encode`: the encode server, run by hypercorn until SIGTERM or SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from common.roles import ENCODE_ROLE
from neuron_connector import Registration, WorkerRecord
from worker.config import EngineConfig
from worker.encode.app import EncodeSettings, create_encode_app
from worker.encode.ref import DTYPES
from worker.model.loader import BUILTIN_MODEL_NAME, builtin_model_path, load_config
from worker.multimodal.media import MediaPolicy

MB = 2**20


def region_rows(args: argparse.Namespace, hidden_size: int, dtype_name: str) -> int:
    itemsize = DTYPES[dtype_name].itemsize
    return max(2, int(args.embeds_region_mb * MB) // (hidden_size * itemsize))


async def run_encode_server(args: argparse.Namespace, engine_config: EngineConfig, server: HypercornConfig) -> None:
    """Serves the encode app with hypercorn `server`; with --etcd registers it under role "encode" while it
    serves."""
    path = Path(engine_config.model) if engine_config.model else builtin_model_path()
    model = load_config(path)
    host = args.advertise_host or args.host
    settings = EncodeSettings(
        hidden_size=model.hidden_size, dtype=DTYPES[engine_config.dtype],
        media=MediaPolicy(Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
                          args.max_file_size_mb),
        transport=args.kv_transport, transfer_host=args.kv_host,
        capacity_rows=region_rows(args, model.hidden_size, engine_config.dtype), ttl=args.embeds_ttl,
        pull_timeout=args.kv_pull_timeout, secret=args.kv_secret)
    app = create_encode_app(settings, f"http://{host}:{args.port}")
    worker = app.extensions["neuron_di_encode"]
    worker.record = WorkerRecord(
        role=ENCODE_ROLE, host=host, http_port=args.port, kv_host=args.kv_host, kv_port=0, engine_id=args.engine_id,
        transfer={"backend": args.kv_transport},
        model=engine_config.served_model_name or (BUILTIN_MODEL_NAME if engine_config.model is None else path.name))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    registration = Registration(args.etcd, worker.record, ttl=args.etcd_ttl) if args.etcd else None
    if registration is not None:
        app.before_serving(lambda: asyncio.to_thread(registration.start))
        app.after_serving(lambda: asyncio.to_thread(registration.stop))
    await serve(app, server, shutdown_trigger=stop.wait)
