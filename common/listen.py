"""A server's listening socket, bound before anything else starts.

The proxy and the worker bind their HTTP port first, so a port in use (or an address this host
does not have) stops them at once with one line naming the address, before a model loads or a
client session opens; hypercorn then serves on the bound socket (`fd://N`).
"""
from __future__ import annotations

import errno
import socket

from common.errors import ListenError


def listen_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A TCP socket bound to (`host`, `port`); ListenError naming the address (and `flag`) if it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT does not count
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = f" (another server listens there; pick another {flag})" if exc.errno == errno.EADDRINUSE else ""
        raise ListenError(f"cannot listen on {_address(host, port)}: {exc.strerror or exc}{hint}") from exc
    return sock


def hypercorn_bind(sock: socket.socket) -> str:
    """Hypercorn's bind string for `sock`, which hypercorn then owns (it closes it when it stops)."""
    return f"fd://{sock.detach()}"


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
