"""Same-host transport: the peer's pool is mapped from POSIX shared memory and a transfer
is one memcpy per (run, layer, k/v) chunk range, straight from source to destination
blocks, with no serialization and no peer involvement. The copies run in a native loop
(transfer.memcopy), one call per plane, without the GIL.

Because the copy is one-sided, the peer cannot report failures itself: a link watches
the peer process through a pidfd (immune to pid reuse) and the segment's state word,
before and after every copy.
"""
from __future__ import annotations

import os
import select
from typing import Any, Sequence

from transfer.backend import Backend, Link, remaining
from transfer.blocks import Run, local_ranges, remote_ranges
from transfer.errors import PeerLost, RegionNotRegistered, StaleHandoff, TransferError
from transfer.fences import Fences, run_blocks
from transfer.fences import available as fences_available
from transfer.landing import LandingMarks
from transfer.layout import KVLayout
from transfer.memcopy import copy_ranges, copy_ranges_crc32c
from transfer.region import Region, ShmSegment, host_identity, unlink_segment

# How long a peer whose segment is missing may take to finish exiting before we call it unregistered.
_EXIT_GRACE_S = 0.5
_CALL_BYTES = 64 << 20   # bytes copied per native call, at most (one plane at least)


class _ProcessWatch:
    """Tells whether a same-host process is still alive."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError as exc:
            raise PeerLost(f"peer process {pid} is gone") from exc
        except OSError:
            self._fd = None  # no pidfd support: fall back to signal 0

    def alive(self, grace: float = 0.0) -> bool:
        """False once the process has exited; waits up to `grace` seconds for that."""
        if self._fd is None:
            try:
                os.kill(self.pid, 0)
                return True
            except ProcessLookupError:
                return False
        # A pidfd becomes readable when the process exits: all its threads, not just the first.
        return not select.select([self._fd], [], [], grace)[0]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ShmLink(Link):
    """The peer's pool mapped into this process; a transfer is memcpy per chunk range."""

    def __init__(self, segment: ShmSegment, watch: _ProcessWatch, layout: KVLayout) -> None:
        self._segment = segment
        self._watch = watch
        self._layout = layout
        self._address = segment.pool_flat.data_ptr()
        self._fences = Fences(segment.fence_words) if fences_available() and segment.fence_words.numel() else None
        self._marks = LandingMarks(segment.landing_words) if self._fences is not None else None

    def write(self, region: Region, runs: Sequence[Run], deadline: float, generation: int | None = None) -> None:
        self._fenced(region, runs, deadline, None, generation)

    def write_summed(self, region: Region, runs: Sequence[Run], deadline: float,
                     generation: int | None = None) -> int:
        crc = self._fenced(region, runs, deadline, 0, generation)
        assert crc is not None
        return crc

    def _fenced(self, region: Region, runs: Sequence[Run], deadline: float, crc: int | None,
                generation: int | None) -> int | None:
        """The copy, inside the peer's fence of the handoff: its blocks are ours to write only while
        we hold them for `generation` (transfer.fences), so a stale handoff writes nothing. While
        we hold them, the copy raises the handoff's landing mark (transfer.landing) as it goes."""
        if generation is None or self._fences is None:
            return self._copy(region, runs, deadline, crc, None)
        blocks = run_blocks([(r.remote, r.count) for r in runs])
        if not self._fences.acquire(blocks, generation):
            raise StaleHandoff(f"peer {self._watch.pid} no longer holds its blocks for handoff {generation}: "
                               "nothing written")
        try:
            crc = self._copy(region, runs, deadline, crc, runs[0].remote)
        finally:
            current = self._fences.release(blocks, generation)
        if not current:
            raise StaleHandoff(f"peer {self._watch.pid} gave up handoff {generation} while it was written")
        return crc

    def _copy(self, region: Region, runs: Sequence[Run], deadline: float, crc: int | None,
              marked: int | None) -> int | None:
        """Copies plane by plane; with a `crc`, extends it by every byte in the same pass; with the
        first block of a handoff (`marked`), raises its landing mark."""
        self._check_peer()
        ours = local_ranges(region.layout, runs)
        theirs = remote_ranges(self._layout, runs).offsets
        # Planes in native calls of up to _CALL_BYTES each: the deadline is checked between calls, and
        # each call is one wait for the GIL, which a busy engine thread (vLLM's worker spins between
        # steps) makes long on a loaded host.
        per_plane = max(1, int(ours.lengths[:len(runs)].sum()))
        step = len(runs) * max(1, _CALL_BYTES // per_plane)
        mark = 0 if marked is None or self._marks is None else self._marks.address(marked)
        for i in range(0, len(ours), step):
            remaining(deadline)
            part = slice(i, i + step)
            args = (self._address, region.address, theirs[part], ours.offsets[part], ours.lengths[part])
            landed = (i // len(runs)) * per_plane   # bytes of the earlier calls
            if crc is None:
                copy_ranges(*args, mark, landed)
            else:
                crc = copy_ranges_crc32c(*args, crc, mark, landed)
        self._check_peer()
        return crc

    def _check_peer(self) -> None:
        if not self._watch.alive():
            # The owner died without unlinking its segment; nobody else will.
            unlink_segment(self._segment.name)
            raise PeerLost(f"peer process {self._watch.pid} died")
        if not self._segment.registered:
            raise RegionNotRegistered(f"peer unregistered its region {self._segment.name}")

    def close(self) -> None:
        self._watch.close()


class ShmBackend(Backend):
    """Offers a pool allocated in shared memory; reaches peers on the same host."""

    name = "shm"

    def __init__(self) -> None:
        self._region: Region | None = None
        self._host_id = host_identity()

    def bind(self, region: Region) -> None:
        self._region = region

    def unbind(self) -> None:
        self._region = None

    def describe(self) -> dict[str, Any] | None:
        if self._region is None or self._region.segment is None:
            return None
        return {"segment": self._region.segment.name}

    def reaches(self, descriptor: dict[str, Any]) -> bool:
        return descriptor.get("host_id") == self._host_id and "shm" in descriptor.get("transports", {})

    def connect(self, descriptor: dict[str, Any], peer_layout: KVLayout, deadline: float) -> Link:
        watch = _ProcessWatch(int(descriptor["pid"]))
        try:
            segment = ShmSegment(descriptor["transports"]["shm"]["segment"],
                                 peer_layout.total_bytes, create=False, num_blocks=peer_layout.num_blocks)
        except TransferError as exc:
            # A killed owner's segment is gone too (unlinked by a link that saw it die), and the
            # owner may still be tearing down its threads: that is a lost peer, not a pool the
            # owner unregistered.
            alive = watch.alive(grace=min(_EXIT_GRACE_S, remaining(deadline)))
            watch.close()
            if not alive:
                raise PeerLost(f"peer process {watch.pid} died") from exc
            raise
        except OSError as exc:
            watch.close()
            raise PeerLost(f"cannot map peer segment: {exc}") from exc
        return ShmLink(segment, watch, peer_layout)
