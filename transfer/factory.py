"""Choosing backends by name, and handing the KV secret to the transports that use it.

With a secret: tcp authenticates every writer; shm is same-host only (its pool segments are
created mode 0600, so only this user's processes map them); nixl cannot authenticate its
peers, so selecting it is an error, and `auto` never picks it anyway.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable

from transfer.backend import Backend
from transfer.engine import TransferEngine, new_transfer_id
from transfer.errors import BackendUnavailable

BACKENDS = ("auto", "shm", "tcp", "nixl", "neuron")


def _shm(host: str, transfer_id: str, secret: bytes | None, **opts: Any) -> list[Backend]:
    from transfer.shm import ShmBackend
    return [ShmBackend()]


def _tcp(host: str, transfer_id: str, secret: bytes | None, **opts: Any) -> list[Backend]:
    from transfer.tcp import TcpBackend
    return [TcpBackend(host, transfer_id=transfer_id, secret=secret, **opts)]


def _nixl(host: str, transfer_id: str, secret: bytes | None, **opts: Any) -> list[Backend]:
    if secret is not None:
        raise BackendUnavailable("the nixl transport cannot authenticate its peers, so it does not run with a "
                                 "KV secret; use tcp or shm (or auto), or run without --kv-secret-file")
    from transfer.nixl import NixlBackend
    return [NixlBackend(transfer_id, **opts)]


def _neuron(host: str, transfer_id: str, secret: bytes | None, **opts: Any) -> list[Backend]:
    from transfer.neuron import NeuronBackend
    return [NeuronBackend(transfer_id, host, **opts)]


def _auto(host: str, transfer_id: str, secret: bytes | None, **opts: Any) -> list[Backend]:
    # Each peer gets the first transport that reaches it: shm on the same host, else tcp.
    if _neuron_available():
        return _neuron(host, transfer_id, secret, **opts)
    return _shm(host, transfer_id, secret) + _tcp(host, transfer_id, secret, **opts)


_FACTORIES: dict[str, Callable[..., list[Backend]]] = {
    "shm": _shm, "tcp": _tcp, "nixl": _nixl, "neuron": _neuron, "auto": _auto}


def _neuron_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None


def _nixl_available() -> bool:
    return importlib.util.find_spec("nixl") is not None


def available_backends() -> list[str]:
    """Backend names that can run on this machine."""
    optional = {"nixl": _nixl_available(), "neuron": _neuron_available()}
    return [name for name in BACKENDS if optional.get(name, True)]


def create_transfer_engine(backend: str = "auto", host: str = "127.0.0.1", secret: bytes | None = None,
                           **opts: Any) -> TransferEngine:
    """A TransferEngine using `backend`; `host` is where tcp listens and is reached (loopback
    unless told otherwise); `secret`: the shared KV secret, or None (unauthenticated).

    Raises BackendUnavailable for a backend this machine cannot run (or nixl with a secret),
    ValueError for an unknown name.
    """
    factory = _FACTORIES.get(backend)
    if factory is None:
        raise ValueError(f"unknown transfer backend {backend!r}; expected one of {BACKENDS}")
    transfer_id = new_transfer_id()
    backends = factory(host, transfer_id, secret, **opts)
    return TransferEngine(backends, shm_pool=any(b.name == "shm" for b in backends), transfer_id=transfer_id)
