"""NIXL transport: one NIXL agent per engine with the UCX backend over registered host
memory (optional extra `neuron-di[nixl]`).

Our descriptor carries the agent's metadata (base64) and the pool's address; a peer adds
us as a remote agent and posts one-sided WRITE requests whose descriptor lists are the
runs' chunk ranges on both sides.
"""
from __future__ import annotations

import base64
import threading
import time
from typing import Any, Sequence

from transfer.backend import Backend, Link, remaining
from transfer.blocks import Run, local_ranges, remote_ranges
from transfer.errors import BackendUnavailable, PeerLost, TransferError
from transfer.layout import KVLayout
from transfer.region import Region

# Between polls of a posted request: short enough to add little latency, long enough
# not to burn a core that the engine loop needs.
_POLL_SECONDS = 0.0002


def _load_nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as exc:
        raise BackendUnavailable("the nixl backend needs `pip install neuron-di[nixl]`") from exc
    return _api


class NixlLink(Link):
    """A remote NIXL agent; a transfer is one posted request over all chunk ranges."""

    def __init__(self, backend: NixlBackend, remote: str, address: int, layout: KVLayout) -> None:
        self._backend = backend
        self._remote = remote
        self._address = address
        self._layout = layout

    def write(self, region: Region, runs: Sequence[Run], deadline: float, generation: int | None = None) -> None:
        # One-sided RDMA writes: the peer's fence words are not taken (nixl writes are not fenced).
        agent, lock = self._backend.agent, self._backend.lock
        ours = [(region.address + off, n, 0) for off, n in local_ranges(region.layout, runs).pairs()]
        theirs = [(self._address + off, n, 0) for off, n in remote_ranges(self._layout, runs).pairs()]
        handle = None
        try:
            with lock:
                handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(ours, "DRAM"),
                                               agent.get_xfer_descs(theirs, "DRAM"), self._remote)
                state = agent.transfer(handle)
            while state == "PROC":
                remaining(deadline)
                time.sleep(_POLL_SECONDS)
                with lock:
                    state = agent.check_xfer_state(handle)
        except TransferError:
            raise
        except Exception as exc:  # noqa: BLE001 - nixl's native errors have no common base
            raise PeerLost(f"nixl WRITE to {self._remote} failed: {exc!r}") from exc
        finally:
            if handle is not None:
                self._release(handle)
        if state != "DONE":
            raise PeerLost(f"nixl WRITE to {self._remote} failed ({state})")

    def _release(self, handle: Any) -> None:
        with self._backend.lock:
            try:
                self._backend.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - an unfinished request may refuse release
                pass

    def close(self) -> None:
        with self._backend.lock:
            try:
                self._backend.agent.remove_remote_agent(self._remote)
            except Exception:  # noqa: BLE001 - already removed or never fully added
                pass


class NixlBackend(Backend):
    """Registers the pool with a NIXL agent and reaches peers that offer nixl."""

    name = "nixl"

    def __init__(self, transfer_id: str, backends: Sequence[str] = ("UCX",)) -> None:
        api = _load_nixl()
        try:
            self.agent = api.nixl_agent(transfer_id, api.nixl_agent_config(backends=list(backends)))
        except Exception as exc:  # noqa: BLE001 - the native layer raises plain errors
            raise BackendUnavailable(f"cannot start a NIXL agent: {exc}") from exc
        if not set(backends) <= set(self.agent.backends):
            raise BackendUnavailable(f"NIXL plugins {list(backends)} not available here")
        # One agent serves every peer thread; its native calls are not re-entrant here.
        self.lock = threading.Lock()
        self._region: Region | None = None
        self._registration: Any = None

    def bind(self, region: Region) -> None:
        with self.lock:
            self._registration = self.agent.register_memory(region.flat)
        self._region = region

    def unbind(self) -> None:
        if self._registration is not None:
            with self.lock:
                self.agent.deregister_memory(self._registration)
            self._registration = None
        self._region = None

    def describe(self) -> dict[str, Any] | None:
        if self._region is None:
            return None
        with self.lock:
            metadata = self.agent.get_agent_metadata()
        return {"agent": self.agent.name, "address": self._region.address,
                "metadata": base64.b64encode(metadata).decode()}

    def reaches(self, descriptor: dict[str, Any]) -> bool:
        return "nixl" in descriptor.get("transports", {})

    def connect(self, descriptor: dict[str, Any], peer_layout: KVLayout, deadline: float) -> Link:
        info = descriptor["transports"]["nixl"]
        try:
            with self.lock:
                remote = self.agent.add_remote_agent(base64.b64decode(info["metadata"]))
        except Exception as exc:  # noqa: BLE001
            raise PeerLost(f"cannot add NIXL agent {info.get('agent')}: {exc}") from exc
        name = remote.decode() if isinstance(remote, bytes) else str(remote)
        return NixlLink(self, name, int(info["address"]), peer_layout)


