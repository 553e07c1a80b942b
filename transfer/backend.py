"""The interface every transport implements: offer our region, reach a peer's."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

from transfer.blocks import Run
from transfer.checksum import runs_crc32c
from transfer.errors import TransferTimeout
from transfer.layout import KVLayout
from transfer.region import Region


class Link(ABC):
    """A connection to one peer's region. Used by one thread at a time."""

    @abstractmethod
    def write(self, region: Region, runs: Sequence[Run], deadline: float, generation: int | None = None) -> None:
        """Copies our blocks (run.local) into the peer's blocks (run.remote). With a handoff
        `generation`, the transports that fence (shm, tcp) write only into blocks the peer holds
        open for it (transfer.fences), and raise StaleHandoff otherwise."""

    def write_summed(self, region: Region, runs: Sequence[Run], deadline: float,
                     generation: int | None = None) -> int:
        """`write`, and the CRC-32C of the bytes sent (transfer.checksum). Transports that copy
        the bytes themselves sum them in the copy's pass; the others read them once more here,
        on the peer's transfer thread."""
        self.write(region, runs, deadline, generation)
        return runs_crc32c(region, runs)

    @abstractmethod
    def close(self) -> None:
        """Frees the link's sockets or mappings; idempotent."""


class Backend(ABC):
    """One transport. The engine binds it to the registered region and asks it for links."""

    name: ClassVar[str]

    @abstractmethod
    def bind(self, region: Region) -> None:
        """Starts offering `region` to peers (listeners, memory registration)."""

    @abstractmethod
    def unbind(self) -> None:
        """Stops offering the region; peers' later transfers fail with RegionNotRegistered."""

    @abstractmethod
    def describe(self) -> dict[str, Any] | None:
        """This transport's entry of our descriptor, or None when it cannot be offered."""

    @abstractmethod
    def reaches(self, descriptor: dict[str, Any]) -> bool:
        """Whether this transport can reach the peer that sent `descriptor`."""

    @abstractmethod
    def connect(self, descriptor: dict[str, Any], peer_layout: KVLayout, deadline: float) -> Link:
        """Opens a link to the peer by `deadline`; raises PeerLost if it cannot be reached."""

    def close(self) -> None:
        self.unbind()


def remaining(deadline: float) -> float:
    """Seconds left before `deadline`; raises TransferTimeout once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout("transfer deadline passed")
    return left
