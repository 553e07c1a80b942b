"""`python -m worker`: one worker serving the OpenAI API, run by hypercorn until SIGTERM or SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Sequence

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from worker.config import EngineConfig

logger = logging.getLogger("worker")
ROLES = ("both", "prefill", "decode")
SUPPORTED_ROLES = ("both",)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port(text: str) -> int:
    value = _positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line, one argument group per concern, so the KV-transfer flags get a group of their own."""
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    server = parser.add_argument_group("server")
    server.add_argument("--role", choices=ROLES, default="both",
                        help="both: prefill and decode here; prefill/decode: one side of disaggregated serving")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=_port, default=8100)
    server.add_argument("--threads", type=_positive, default=None, help="torch intra-op threads")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    engine.add_argument("--served-model-name", default=None)
    engine.add_argument("--block-size", type=_positive, default=16)
    engine.add_argument("--num-kv-blocks", type=_positive, default=None)
    engine.add_argument("--max-num-seqs", type=_positive, default=16)
    engine.add_argument("--max-waiting", type=_positive, default=256)
    engine.add_argument("--max-model-len", type=_positive, default=None)
    engine.add_argument("--seed", type=int, default=0)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    """Parses and validates everything up front; a bad value exits with status 2 and a clear message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.role not in SUPPORTED_ROLES:
        parser.error(f"--role {args.role} is not yet supported (supported: {', '.join(SUPPORTED_ROLES)})")
    try:
        config = EngineConfig(model=args.model, served_model_name=args.served_model_name,
                              block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                              max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                              max_model_len=args.max_model_len, seed=args.seed, role=args.role)
    except ValueError as exc:
        parser.error(str(exc))
    return args, config


def hypercorn_config(host: str, port: int) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.startup_timeout = 600  # loading a real model can take minutes
    config.graceful_timeout = 5
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # into our logging setup, printed once
    return config


async def run_server(args: argparse.Namespace, engine_config: EngineConfig) -> None:
    """Serves until SIGTERM/SIGINT, then drains: hypercorn stops accepting, the engine thread is joined."""
    from worker.server import create_app  # imports torch: only once the command line is known to be good

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = create_app(engine_config)
    logger.info("starting the engine, then serving on http://%s:%d (role %s)", args.host, args.port, args.role)
    await serve(app, hypercorn_config(args.host, args.port), shutdown_trigger=stop.wait)


def main(argv: Sequence[str] | None = None) -> int:
    args, engine_config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        asyncio.run(run_server(args, engine_config))
    except Exception as exc:  # startup failures (bad model path, port in use) end with a message, not a trace
        logger.error("worker failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
