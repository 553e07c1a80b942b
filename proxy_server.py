"""OpenAI-compatible prefill/decode proxy.

    python proxy_server.py --prefill-ip 10.0.0.1 --prefill-port 8100 \\
                           --decode-ip 10.0.0.2 --decode-port 8200 --port 8000
    python proxy_server.py --etcd 10.0.0.9:2379
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Sequence

from hypercorn.asyncio import serve
from hypercorn.config import Config

from common.errors import ListenError
from common.listen import hypercorn_bind, listen_socket
from proxy import ConfigError, ProxyConfig, create_app, parse_args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        print(f"proxy_server.py: error: {exc}", file=sys.stderr)
        return 2
    try:  # before anything starts: a port in use is one line, not a traceback after the first health checks
        listener = listen_socket(config.host, config.port)
    except ListenError as exc:
        print(f"proxy_server.py: error: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hyper = Config()
    hyper.bind = [hypercorn_bind(listener)]
    hyper.errorlog = logging.getLogger("hypercorn.error")  # into our logging setup, printed once
    hyper.keep_alive_timeout = 75  # longer than clients' idle pool timeouts, so we never drop a reused socket
    hyper.keep_alive_max_requests = 1_000_000  # hypercorn's 1000 would make pooled clients reconnect
    hyper.accesslog = None
    # Connections are cut only after the streams ended at the grace's end have sent their error events.
    hyper.graceful_timeout = config.shutdown_grace + 5
    asyncio.run(_serve(config, hyper))
    return 0


async def _serve(config: ProxyConfig, hyper: Config) -> None:
    """Serves until SIGTERM/SIGINT; then streams get `config.shutdown_grace` seconds before they end with an error."""
    app = create_app(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def shutdown_trigger() -> None:
        await stop.wait()
        loop.call_later(config.shutdown_grace, app.config["PROXY_STATE"].forwarder.legs.end_streams)

    await serve(app, hyper, shutdown_trigger=shutdown_trigger)


if __name__ == "__main__":
    sys.exit(main())
