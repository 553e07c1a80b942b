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
from worker.multimodal.ref import DTYPES
from worker.multimodal.rows import rows_in
from worker.model.loader import BUILTIN_MODEL_NAME, builtin_model_path, load_config
from worker.multimodal.media import MediaPolicy

async def run_encode_server(args: argparse.Namespace, engine_config: EngineConfig, server: HypercornConfig,
                            media: MediaPolicy) -> None:
    """Serves the encode app with hypercorn `server`, loading image parts as `media` allows; with --etcd
    registers it under role "encode" while it serves."""
    path = Path(engine_config.model) if engine_config.model else builtin_model_path()
    model = load_config(path)
    host = args.advertise_host or args.host
    settings = EncodeSettings(
        hidden_size=model.hidden_size, dtype=DTYPES[engine_config.dtype],
        media=media,
        transport=args.kv_transport, transfer_host=args.kv_host,
        capacity_rows=rows_in(args.embeds_region_mb, model.hidden_size, DTYPES[engine_config.dtype]),
        ttl=args.embeds_ttl,
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
    if args.etcd:
        registration = Registration(args.etcd, worker.record, ttl=args.etcd_ttl)

        async def register() -> None:
            await asyncio.to_thread(registration.start)

        async def unregister() -> None:
            await asyncio.to_thread(registration.stop)
        app.before_serving(register)
        app.after_serving(unregister)
    await serve(app, server, shutdown_trigger=stop.wait)
