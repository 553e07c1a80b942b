"""OpenAI-compatible prefill/decode proxy.

    python proxy_server.py --prefill-ip 10.0.0.1 --prefill-port 8100 \\
                           --decode-ip 10.0.0.2 --decode-port 8200 --port 8000
    python proxy_server.py --etcd 10.0.0.9:2379
"""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import Sequence

from hypercorn.asyncio import serve
from hypercorn.config import Config

from proxy import ConfigError, create_app, parse_args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        print(f"proxy_server.py: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hypercorn.error").propagate = False  # hypercorn logs it already
    hyper = Config()
    hyper.bind = [f"{config.host}:{config.port}"]
    hyper.keep_alive_timeout = 75  # longer than clients' idle pool timeouts, so we never drop a reused socket
    hyper.keep_alive_max_requests = 1_000_000  # hypercorn's 1000 would make pooled clients reconnect
    hyper.accesslog = None
    asyncio.run(serve(create_app(config), hyper))
    return 0


if __name__ == "__main__":
    sys.exit(main())
