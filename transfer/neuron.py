"""Neuron runtime transport (torch-neuronx): KV copies run by the runtime's transfer engine.

Only usable where torch-neuronx is installed; everywhere else constructing the backend
raises BackendUnavailable. It is a thin adapter over the runtime's own engine: each link
opens one send communicator from our NeuronCore to the peer's and hands the runtime's
`queue_transfer_with_token` the chunk ranges, polling its token against our deadline.

The pool is not in device memory: like every backend's, it is the engine's region, a
contiguous CPU tensor in host memory (allocate_region makes it with plain torch.empty, not
in shared memory, since no shm backend runs beside this one), and that host tensor is what
the runtime is given as the source of each transfer.
"""
from __future__ import annotations

import importlib
import time
from typing import Any, Sequence

from transfer.backend import Backend, Link, remaining
from transfer.blocks import Run, local_ranges, remote_ranges
from transfer.errors import BackendUnavailable, PeerLost
from transfer.layout import KVLayout
from transfer.region import Region

_POLL_SECONDS = 0.0005
_BATCH = 128


def _load_runtime() -> Any:
    try:
        importlib.import_module("torch_neuronx")
        import torch
    except ImportError as exc:
        raise BackendUnavailable("the neuron backend needs torch-neuronx "
                                 "(Trainium/Inferentia hosts)") from exc
    return torch


class NeuronLink(Link):
    """A send communicator to the peer's core, driving the runtime's transfer engine."""

    def __init__(self, torch: Any, remote_ip: str, core: int, peer_core: int, layout: KVLayout) -> None:
        self._torch = torch
        self._layout = layout
        self._peer_core = peer_core
        self._core = core
        self._send = torch.ops.neuron._nrt_create_send_communicator(remote_ip, peer_core, core)
        self._engine = torch.classes.neuron.NeuronTransferEngine(_BATCH, remote_ip, True, 0)

    def write(self, region: Region, runs: Sequence[Run], deadline: float, generation: int | None = None) -> None:
        ours = local_ranges(region.layout, runs)
        theirs = remote_ranges(self._layout, runs)
        token = self._torch.classes.neuron.CompletionToken()
        self._engine.queue_transfer_with_token(
            [region.tensor] * len(ours), ours.offsets.tolist(), ours.lengths.tolist(),
            [self._peer_core] * len(theirs), [self._core] * len(ours), [self._send] * len(ours),
            len(ours), token, True, int(remaining(deadline)) + 1)
        while not token.is_done():
            remaining(deadline)
            time.sleep(_POLL_SECONDS)
        if getattr(token, "has_error", lambda: False)():
            raise PeerLost("the Neuron runtime reported a failed transfer")

    def close(self) -> None:
        self._engine = None


class NeuronBackend(Backend):
    """Describes our pool by host and NeuronCore `core` to peers that also run the neuron backend."""

    name = "neuron"

    def __init__(self, transfer_id: str, host: str, core: int = 0) -> None:
        self._torch = _load_runtime()
        self._host = host
        self._core = core
        self._region: Region | None = None

    def bind(self, region: Region) -> None:
        self._region = region

    def unbind(self) -> None:
        self._region = None

    def describe(self) -> dict[str, Any] | None:
        return None if self._region is None else {"ip": self._host, "core": self._core}

    def reaches(self, descriptor: dict[str, Any]) -> bool:
        return "neuron" in descriptor.get("transports", {})

    def connect(self, descriptor: dict[str, Any], peer_layout: KVLayout, deadline: float) -> Link:
        info = descriptor["transports"]["neuron"]
        try:
            return NeuronLink(self._torch, info["ip"], self._core, int(info["core"]), peer_layout)
        except RuntimeError as exc:
            raise PeerLost(f"cannot create a Neuron communicator: {exc}") from exc
