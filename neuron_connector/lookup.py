"""The prefill side's lookup table, sans I/O: which finished requests hold which blocks.

Every published request ends in exactly one release (its blocks go back to the engine):
after its transfer completes or fails, when the engine discards it, when its decode peer
releases it (its request is gone there), or when nobody pulled it within `abort_timeout`.
A finished request leaves a tombstone for `abort_timeout` so a repeated lookup (a lost
reply, a reconnecting peer) gets the same final answer; a request discarded or released
before it was published leaves one too, so its lookup fails at once and, if released, its
publish frees the blocks at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from neuron_connector.errors import DuplicateRequest
from neuron_connector.protocol import LookupReply


@dataclass(frozen=True, slots=True)
class NotReady:
    """Not published (yet): the peer retries until its deadline."""


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer at once with this final reply."""

    reply: LookupReply


@dataclass(frozen=True, slots=True)
class Start:
    """Queue the transfer of `src` (ours) into `dst` (the peer's): the last len(dst) blocks
    of the request, so a peer that has the prompt's head cached pulls only the tail."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class InProgress:
    """Already transferring to this peer; the reply goes out when it completes."""


Decision = Union[NotReady, Answer, Start, InProgress]


@dataclass(slots=True)
class _Entry:
    block_ids: tuple[int, ...]
    output_token: int | None           # None: not known when published (a vLLM prefill worker's)
    published_at: float
    peer: bytes | None = None          # set once a transfer started
    dst: tuple[int, ...] = ()
    ended: str | None = None           # discarded or released mid-transfer: the error it ends with


@dataclass(slots=True)
class _Tombstone:
    peer: bytes | None
    reply: LookupReply
    expires_at: float
    released: bool = False             # released by its decode peer before it was published


@dataclass
class LookupTable:
    """Published requests of one prefill engine; not thread-safe (the owner locks)."""

    abort_timeout: float
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _tombstones: dict[str, _Tombstone] = field(default_factory=dict)
    _releases: list[str] = field(default_factory=list)

    def publish(self, request_id: str, block_ids: list[int], output_token: int | None, now: float) -> bool:
        """Holds the blocks for a lookup; False: released at once, its decode peer gave it up already."""
        if self.known(request_id):
            raise DuplicateRequest(f"request {request_id!r} was already published")
        self._entries[request_id] = _Entry(tuple(block_ids), output_token, now)
        tomb = self._tombstones.get(request_id)
        if tomb is None:
            return True
        self._finish(request_id, None, tomb.reply.error, now)
        return False

    def known(self, request_id: str) -> bool:
        """Whether `request_id` is published or remembered; publishing it again would be refused.

        An id only its decode peer released is not: the prefill leg may still come, and its
        publish then frees the blocks at once.
        """
        tomb = self._tombstones.get(request_id)
        return request_id in self._entries or (tomb is not None and not tomb.released)

    def ready(self, request_id: str) -> bool:
        """Whether a lookup of `request_id` gets a decision now (not NotReady)."""
        return request_id in self._entries or request_id in self._tombstones

    def discard(self, request_id: str, now: float) -> None:
        """The engine aborted the request: release now, or once its running transfer ends."""
        self._end(request_id, f"request {request_id!r} was aborted on the prefill side", now, released=False)

    def release(self, request_id: str, peer: bytes, now: float) -> bool:
        """Decode peer `peer` dropped the request: release now, once the transfer into its
        blocks ended, or (not published yet) as soon as it is published.

        A request being pulled is bound to its puller: another peer's release is refused
        (False). One nobody pulls yet has no peer to check against; its id is the request's
        own, which only its decode leg knows.
        """
        entry = self._entries.get(request_id)
        if entry is not None and entry.peer not in (None, peer):
            return False
        self._end(request_id, f"request {request_id!r} was released by its decode peer", now, released=True)
        return True

    def lookup(self, request_id: str, peer: bytes, dst: tuple[int, ...], skipped: int | None = None) -> Decision:
        """`skipped`: leading blocks the peer holds already; with it, `dst` must cover the rest exactly."""
        def refuse(why: str) -> Answer:
            return Answer(LookupReply(request_id, False, error=f"request {request_id!r} {why}"))

        tomb = self._tombstones.get(request_id)
        if tomb is not None:
            return Answer(tomb.reply) if tomb.peer in (None, peer) else refuse("was pulled by another peer")
        entry = self._entries.get(request_id)
        if entry is None:
            return NotReady()
        if entry.peer is not None:
            return InProgress() if entry.peer == peer else refuse("is being pulled by another peer")
        if len(dst) > len(entry.block_ids):
            return refuse(f"holds {len(entry.block_ids)} blocks, peer offered {len(dst)}")
        if skipped is not None and skipped + len(dst) != len(entry.block_ids):
            return refuse(f"holds {len(entry.block_ids)} blocks, peer holds {skipped} and offered {len(dst)} "
                          "for the rest (the two sides see different prompts)")
        entry.peer, entry.dst = peer, dst
        # Fewer blocks: the peer already holds the prompt's first blocks (its prefix cache).
        return Start(entry.block_ids[len(entry.block_ids) - len(dst):], dst)

    def transfer_done(self, request_id: str, error: str | None, now: float,
                      checksum: int | None = None) -> tuple[bytes, LookupReply] | None:
        """Ends a started transfer; returns (peer, reply) to send, and queues the release.
        `checksum`: of the blocks sent, for a lookup that asked for one."""
        entry = self._entries.get(request_id)
        if entry is None or entry.peer is None:
            return None
        peer = entry.peer
        return peer, self._finish(request_id, peer, error or entry.ended, now, checksum)

    def expire(self, now: float) -> None:
        """Releases requests nobody pulled within abort_timeout; forgets old tombstones."""
        stale = [rid for rid, e in self._entries.items()
                 if e.peer is None and now - e.published_at >= self.abort_timeout]
        for rid in stale:
            self._finish(rid, None, f"request {rid!r} was not pulled within {self.abort_timeout}s; "
                         "its blocks were released", now)
        for rid in [rid for rid, t in self._tombstones.items() if t.expires_at <= now]:
            del self._tombstones[rid]

    def release_all(self, reason: str, now: float) -> None:
        """Shutdown: every held request is released, running transfers included."""
        for rid, entry in list(self._entries.items()):
            self._finish(rid, entry.peer, f"request {rid!r}: {reason}", now)

    def take_releases(self) -> list[str]:
        """Request ids whose blocks may be freed now, each reported exactly once."""
        released, self._releases = self._releases, []
        return released

    def pending(self) -> int:
        return len(self._entries)

    def _end(self, request_id: str, error: str, now: float, released: bool) -> None:
        """Ends a request the engine or its peer dropped: at once, after its running transfer,
        or, not published yet, by a tombstone (a later lookup fails at once, not at the peer's
        deadline)."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.peer is not None:
            entry.ended = entry.ended or error
        elif entry is not None:
            self._finish(request_id, None, error, now)
        elif request_id not in self._tombstones:
            self._tombstones[request_id] = _Tombstone(None, LookupReply(request_id, False, error=error),
                                                      now + self.abort_timeout, released)

    def _finish(self, request_id: str, peer: bytes | None, error: str | None, now: float,
                checksum: int | None = None) -> LookupReply:
        entry = self._entries.pop(request_id)
        if error is None:
            reply = LookupReply(request_id, True, entry.output_token, entry.dst, checksum=checksum)
        else:
            reply = LookupReply(request_id, False, error=error)
        self._tombstones[request_id] = _Tombstone(peer, reply, now + self.abort_timeout)
        self._releases.append(request_id)
        return reply
