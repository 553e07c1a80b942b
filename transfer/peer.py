"""One connected peer: a job queue drained by a worker thread that owns the peer's link."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from transfer.backend import Link
from transfer.blocks import Run
from transfer.errors import PeerLost, RegionNotRegistered, TransferError, TransferTimeout
from transfer.layout import KVLayout
from transfer.region import Region
from transfer.token import CompletionToken

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Job:
    token: CompletionToken
    region: Region
    runs: Sequence[Run]
    summed: bool = False     # the token also reports the CRC-32C of the bytes sent
    generation: int | None = None   # the receiver's handoff generation (transfer.fences)


class Peer:
    """Runs a peer's transfers in order on its own thread, so the caller never blocks.

    The link is opened lazily and dropped after any failure, so one bad transfer (peer
    restarted, stalled or killed) never poisons the next one: it reconnects or fails
    with its own typed error.
    """

    def __init__(self, peer_id: str, backend_name: str, layout: KVLayout,
                 open_link: Callable[[float], Link], current_region: Callable[[], Region | None]) -> None:
        self.peer_id = peer_id
        self.backend_name = backend_name
        self.layout = layout
        self._open_link = open_link
        self._current_region = current_region
        self._link: Link | None = None
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"transfer-{peer_id}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the thread after the transfer in flight; queued ones fail with PeerLost."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(job)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.token._finish(PeerLost(f"peer {self.peer_id} disconnected"))
        self._drop_link()

    def _run(self, job: Job) -> None:
        if not job.token._start():
            return  # expired while queued
        deadline = job.token._deadline
        try:
            if self._current_region() is not job.region:
                raise RegionNotRegistered("the local region was unregistered before the transfer ran")
            if self._link is None:
                self._link = self._open_link(deadline)
            if job.summed:
                checksum: int | None = self._link.write_summed(job.region, job.runs, deadline, job.generation)
            else:
                self._link.write(job.region, job.runs, deadline, job.generation)
                checksum = None
        except (PeerLost, TransferTimeout) as exc:
            # The stream or mapping is in an unknown state: start over next time.
            self._drop_link()
            job.token._finish(exc)
        except TransferError as exc:
            job.token._finish(exc)
        except Exception as exc:  # noqa: BLE001 - any failure must end the token, typed
            log.exception("transfer to %s failed unexpectedly", self.peer_id)
            self._drop_link()
            job.token._finish(TransferError(f"transfer failed: {exc!r}"))
        else:
            job.token._finish(None, checksum)

    def _drop_link(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
