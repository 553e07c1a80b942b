"""The decode side's pulls, sans I/O: when to send `lookup_all`, and what each reply means.

A pull is WAITING (a lookup is due at `next_send_at`), or AWAITING a reply (resent every
`resend_after` seconds, since a reply can be lost when the peer restarts), or terminal.
While a lookup is outstanding the peer may be writing into our blocks, so such a pull is
only failed (timeout or cancel) once the peer answered or `grace` seconds passed after
the deadline: FAILED always means our blocks are safe to reuse. Every pull that turns
terminal is recorded for `take_finished`, so the owner can announce it.

A pull cancelled before it ended, or timed out while the peer kept answering "not yet",
queues a `release` for its peer (`take_notices`): the prefill frees the request's blocks
then, not at its abort timeout. `release` queues one for a request that never had a pull;
`notify` queues any unanswered notice (a write-back offer too), sent the same way. A pull that
turns DONE queues a `pulled` release: the peer learns its KV is safe here (a prefill worker acks
its prefill queue job only then, worker/server/prefill_puller.py).

With `checksum` set, every lookup asks the peer for that checksum of the blocks it sends;
the owner computes the same over our blocks when the reply comes (`on_reply`), and a pull
whose two values differ, or whose peer sent none, fails instead of turning DONE.

A peer whose connection is lost (`peer_lost`: its process ended, or its host went silent past
the heartbeat timeout) fails every pull from it at once: whatever comes back at that address is
another process, which never had their KV. A pull added while the peer is away waits for it
until its deadline, as any pull does (a peer restarted at the address may be its target).

A pull may carry its handoff generation (transfer.fences): its lookups name it, a reply naming
another is dropped (`stale_replies`), and every terminal pull closes its blocks' fence through
`close_blocks` (blocks, generation) -> how many a writer still holds. A pull ended while its
writer holds blocks (a prefill frozen mid-copy) is quarantined: it reports PENDING, its result
withheld, until `unhold` sees the writer let go (or the writer's process gone), so FAILED still
means our blocks are safe to reuse.

A pull may name the prefill engine it expects. A peer whose handshake names another
engine fails it; a pull that began after the handshake first asks for a new one, since the
peer may have restarted as the engine the pull names since.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from neuron_connector.errors import (
    ConnectorError, DuplicateRequest, EngineMismatch, IntegrityError, PeerUnavailable, ProtocolError,
    PullTimeout, UnknownRequest)
from neuron_connector.protocol import LookupAll, LookupReply, Release, WriteBack


class PullState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PullStatus:
    """What `RecvBuffer.poll` reports: PENDING, DONE(output_token) or FAILED(error)."""

    state: PullState
    output_token: int | None = None
    error: ConnectorError | None = None

    @property
    def message(self) -> str | None:
        return None if self.error is None else str(self.error)


PENDING = PullStatus(PullState.PENDING)


@dataclass
class _Pull:
    request_id: str
    peer: str
    dst: tuple[int, ...]
    deadline: float
    next_send_at: float
    backoff: float
    engine_id: str | None = None        # the prefill engine expected at `peer`; None: any
    skipped: int | None = None          # leading blocks we hold already (LookupAll.skipped_blocks)
    traceparent: str | None = None      # the pull's trace span (LookupAll.traceparent)
    sent_at: float | None = None        # set while a lookup is outstanding
    result: PullStatus = PENDING
    cancelled: bool = False
    answered: bool = False              # the peer's success reply came and is being verified: the KV is here
    generation: int | None = None       # the handoff's generation (transfer.fences); None: unfenced
    writer: int | None = None           # pid of the same-host process the lookup went to
    held: bool = False                  # ended, but a writer still holds its blocks: result withheld
    incarnation: str | None = None      # the peer's incarnation its first lookup went to
    added_at: float = 0.0


@dataclass
class PullTracker:
    """All pulls of one decode engine; not thread-safe (the owner locks)."""

    resend_after: float = 1.0
    grace: float = 5.0
    unreachable_s: float = 3.0          # a pull fails after this long with no connection to its peer possible
    first_backoff: float = 0.005
    max_backoff: float = 0.02
    checksum: str | None = None         # one of protocol.CHECKSUMS: verify every pull with it
    close_blocks: Callable[[tuple[int, ...], int], int] | None = None   # fence close: blocks still held
    reclaim_blocks: Callable[[tuple[int, ...], int], None] | None = None  # their writer died holding them

    def __post_init__(self) -> None:
        self._pulls: dict[str, _Pull] = {}
        self._engines: dict[str, str] = {}        # peer -> the engine its latest handshake named
        self._stale: set[str] = set()             # peers to handshake with again
        self._finished: dict[str, None] = {}      # ids turned terminal, not yet taken (in order)
        self._notices: list[tuple[str, Release | WriteBack]] = []  # (peer, what to tell it), unanswered
        self._writers: dict[str, int | None] = {}   # peer -> pid of its process, when on this host
        self._incarnations: dict[str, str | None] = {}   # peer -> the incarnation its latest handshake named
        self.stale_replies = 0                     # replies naming a handoff generation not current
        self.quarantined = 0                       # pulls ended while a writer held their blocks
        self.fenced = 0                            # pulls whose blocks were opened for their handoff generation
        self.other_incarnation = 0                 # pulls failed: another incarnation of their peer answered

    def add(self, request_id: str, peer: str, dst: list[int], deadline: float, now: float,
            engine_id: str | None = None, skipped: int | None = None, traceparent: str | None = None,
            generation: int | None = None) -> None:
        """`dst`: our blocks for the request's blocks after the first `skipped` (None: its last len(dst));
        `generation`: the handoff generation their fence is open for."""
        if request_id in self._pulls:
            raise DuplicateRequest(f"a pull of request {request_id!r} is already registered")
        self._pulls[request_id] = _Pull(request_id, peer, tuple(dst), deadline, now, self.first_backoff,
                                        engine_id, skipped, traceparent, generation=generation, added_at=now)
        self.fenced += generation is not None

    def due(self, now: float, ready_peers: set[str]) -> list[tuple[str, LookupAll]]:
        """(peer, lookup) pairs to send now; marks them outstanding."""
        out = []
        for pull in self._pulls.values():
            if pull.result is not PENDING or pull.cancelled or pull.peer not in ready_peers:
                continue
            resend = pull.sent_at is not None and now - pull.sent_at >= self.resend_after
            if not ((pull.sent_at is None and now >= pull.next_send_at) or resend):
                continue
            if pull.engine_id is not None and self._engines.get(pull.peer) != pull.engine_id:
                # The handshake predates this pull (peer_ready failed the older ones): the
                # peer may have restarted as the engine the pull names since.
                self._stale.add(pull.peer)
                continue
            if pull.writer is None and pull.incarnation is None:    # bound to whoever its first lookup asks
                pull.writer, pull.incarnation = self._writers.get(pull.peer), self._incarnations.get(pull.peer)
            pull.sent_at = now
            left = max(pull.deadline - now, 0.001)
            out.append((pull.peer, LookupAll(pull.request_id, pull.dst, round(left, 3), self.checksum, pull.skipped,
                                             pull.traceparent, pull.generation, pull.incarnation)))
        return out

    def take_stale_peers(self) -> list[str]:
        """Ready peers whose handshake names another engine than a waiting pull expects:
        handshake with them again; `peer_ready` then fails the pulls it still does not match."""
        stale, self._stale = sorted(self._stale), set()
        return stale

    def peer_ready(self, peer: str, engine_id: str, writer: int | None = None, incarnation: str | None = None) -> None:
        """The peer completed a handshake as `engine_id` (`writer`: its pid when on this host): its
        pulls expecting another engine fail, and so do those whose lookups went to another
        incarnation (the process restarted at the address: it never had their KV).

        Even one with a lookup outstanding: another engine answering at the address means the
        one asked is gone, as `resend_peer` assumes after a restart.
        """
        self._engines[peer], self._writers[peer], self._incarnations[peer] = engine_id, writer, incarnation
        for pull in self._pulls.values():
            if (pull.peer == peer and pull.result is PENDING and incarnation is not None
                    and pull.incarnation not in (None, incarnation)):
                self.other_incarnation += 1
                self._end(pull, PullStatus(PullState.FAILED, error=PeerUnavailable(
                    f"pull of {pull.request_id!r}: prefill {engine_id} at {peer} restarted (incarnation "
                    f"{pull.incarnation}, now {incarnation}); the new process never had its KV")))
        for pull in self._pulls.values():
            if pull.peer == peer and pull.result is PENDING and pull.engine_id not in (None, engine_id):
                self._end(pull, PullStatus(PullState.FAILED, error=EngineMismatch(
                    f"pull of {pull.request_id!r}: expected prefill engine {pull.engine_id} at {peer}, "
                    f"found {engine_id}")))

    def on_reply(self, reply: LookupReply, now: float, local_checksum: int | None = None) -> None:
        """`local_checksum`: the checksum of our blocks the reply names, when it carries one."""
        pull = self._pulls.get(reply.request_id)
        if reply.generation is not None and (pull is None or reply.generation != pull.generation):
            self.stale_replies += 1   # the answer of a handoff given up (its request id reused since)
            return
        if pull is None or pull.result is not PENDING or pull.sent_at is None:
            return  # a duplicate answer to a resent lookup
        pull.sent_at = None
        if pull.cancelled:
            self._end(pull, PullStatus(PullState.FAILED, error=UnknownRequest(
                f"pull of {pull.request_id!r} was cancelled")))
        elif reply.success and reply.block_ids_in_peer_device != pull.dst:
            self._end(pull, PullStatus(PullState.FAILED, error=ProtocolError(
                f"prefill peer {pull.peer} filled blocks {list(reply.block_ids_in_peer_device)} of "
                f"{pull.request_id!r}, we offered {list(pull.dst)}")))
        elif reply.success and self.checksum is not None and reply.checksum is None:
            self._end(pull, PullStatus(PullState.FAILED, error=ProtocolError(
                f"prefill peer {pull.peer} sent no {self.checksum} checksum of {pull.request_id!r}")))
        elif reply.success and self.checksum is not None and reply.checksum != local_checksum:
            self._end(pull, PullStatus(PullState.FAILED, error=IntegrityError(
                f"KV blocks of {pull.request_id!r} from prefill peer {pull.peer} are corrupt: {self.checksum} "
                f"{_hex(local_checksum)} of our blocks {list(pull.dst)}, the peer sent {_hex(reply.checksum)}")))
        elif reply.success:
            self._end(pull, PullStatus(PullState.DONE, output_token=reply.output_token))
            self.notify(pull.peer, Release(pull.request_id, pulled=True))
        elif reply.error is not None:
            self._end(pull, PullStatus(PullState.FAILED, error=ConnectorError(
                f"prefill peer {pull.peer} failed request {pull.request_id!r}: {reply.error}")))
        else:
            pull.next_send_at = now + pull.backoff
            pull.backoff = min(2 * pull.backoff, self.max_backoff)

    def resend_peer(self, peer: str) -> None:
        """The peer restarted: nothing it had is in flight; every lookup goes again once
        it is ready (and a cancelled pull is simply over)."""
        for pull in self._pulls.values():
            if pull.peer == peer and pull.result is PENDING:
                pull.sent_at, pull.next_send_at = None, 0.0

    def fail_peer(self, peer: str, error: ConnectorError) -> None:
        """The peer is unreachable or refused us: its pulls fail, and it is told nothing more."""
        for pull in self._pulls.values():
            if pull.peer == peer and pull.result is PENDING:
                self._end(pull, PullStatus(PullState.FAILED, error=error))
        self._notices = [(p, notice) for p, notice in self._notices if p != peer]

    def answered(self, request_id: str) -> None:
        """The peer's success reply to the pull came and is being verified: the peer's part is over."""
        if (pull := self._pulls.get(request_id)) is not None:
            pull.answered = True

    def peer_lost(self, peer: str) -> int:
        """The connection to the peer was lost: its pulls fail now, but those it answered; how many did."""
        lost = [pull for pull in self._pulls.values()
                if pull.peer == peer and pull.result is PENDING and not pull.answered]
        for pull in lost:
            self._end(pull, PullStatus(PullState.FAILED, error=PeerUnavailable(
                f"pull of {pull.request_id!r}: the connection to prefill peer {peer} was lost "
                "(its process ended or its host went silent)")))
        return len(lost)

    def peer_unreachable(self, peer: str, since: float, now: float) -> int:
        """Every connect attempt to the peer has failed since `since`: its pulls that have waited through
        `unreachable_s` of that fail now (there is no process there to have their KV); how many did."""
        failed = [pull for pull in self._pulls.values()
                  if pull.peer == peer and pull.result is PENDING and not pull.answered
                  and now - max(since, pull.added_at) >= self.unreachable_s]
        for pull in failed:
            self._end(pull, PullStatus(PullState.FAILED, error=PeerUnavailable(
                f"pull of {pull.request_id!r}: prefill peer {peer} refused or did not answer every "
                f"connection attempt for {self.unreachable_s:g} s (nothing listens there, or its host is gone)")))
        return len(failed)

    def expire(self, now: float, ready_peers: set[str]) -> None:
        for pull in self._pulls.values():
            if pull.result is not PENDING:
                continue
            if pull.sent_at is not None and now < pull.deadline + self.grace:
                continue
            if pull.cancelled:
                self._end(pull, PullStatus(PullState.FAILED, error=UnknownRequest(
                    f"pull of {pull.request_id!r} was cancelled")))
            elif now >= pull.deadline:
                error = self._timeout_error(pull, ready_peers)
                if isinstance(error, PullTimeout):  # the peer is there and may publish it yet
                    self.release(pull.request_id, pull.peer)
                self._end(pull, PullStatus(PullState.FAILED, error=error))

    def cancel(self, request_id: str) -> bool:
        """True if our blocks are free at once; False: poll until FAILED before reusing them.
        A pull not ended yet tells its peer to release the request."""
        pull = self._pulls.get(request_id)
        if pull is None:
            return True
        if pull.result is PENDING and not pull.cancelled:
            self.release(request_id, pull.peer)
        if pull.held or (pull.sent_at is not None and pull.result is PENDING):
            pull.cancelled = True
            return False
        if pull.result is PENDING:
            pull.cancelled = True
            self._end(pull, PullStatus(PullState.FAILED, error=UnknownRequest(
                f"pull of {pull.request_id!r} was cancelled")))
            if pull.held:
                return False
        self._forget(request_id)
        return True

    def poll(self, request_id: str) -> PullStatus:
        """The pull's status; a terminal status is reported once, then the id is forgotten."""
        pull = self._pulls.get(request_id)
        if pull is None:
            raise UnknownRequest(f"no pull of request {request_id!r} is registered")
        if pull.held:
            return PENDING
        if pull.result is not PENDING:
            self._forget(request_id)
        return pull.result

    def release(self, request_id: str, peer: str) -> None:
        """Queues telling `peer` that our request `request_id` is gone."""
        self.notify(peer, Release(request_id))

    def notify(self, peer: str, notice: Release | WriteBack) -> None:
        """Queues `notice` (unanswered) for `peer`."""
        self._notices.append((peer, notice))

    def take_notices(self, reachable: set[str]) -> list[tuple[str, Release | WriteBack]]:
        """(peer, notice) pairs to send now to the `reachable` peers; the rest wait."""
        out = [(peer, notice) for peer, notice in self._notices if peer in reachable]
        self._notices = [(peer, notice) for peer, notice in self._notices if peer not in reachable]
        return out

    def take_finished(self) -> list[str]:
        """Ids of the pulls that turned DONE or FAILED since the last call, each once; a pull
        `poll` or `cancel` forgot before then is left out."""
        finished, self._finished = list(self._finished), {}
        return finished

    def next_event(self, now: float) -> float:
        """Seconds until something may be due (a send, a resend or an expiry)."""
        times = [self.resend_after]
        for p in self._pulls.values():
            if p.result is PENDING:
                times += [p.deadline - now, (p.next_send_at - now) if p.sent_at is None
                          else (p.sent_at + self.resend_after - now)]
        return max(0.0, min(times))

    def __len__(self) -> int:
        return len(self._pulls)

    def unhold(self, writer_alive: Callable[[int], bool]) -> int:
        """Quarantined pulls whose writer let go of their blocks (or whose writer's process is gone:
        its blocks are reclaimed) turn terminal now; how many are still held."""
        held = 0
        for pull in self._pulls.values():
            if not pull.held:
                continue
            assert self.close_blocks is not None and pull.generation is not None
            if self.close_blocks(pull.dst, pull.generation):
                if pull.writer is None or writer_alive(pull.writer):
                    held += 1
                    continue
                if self.reclaim_blocks is not None:
                    self.reclaim_blocks(pull.dst, pull.generation)
            pull.held = False
            self._finished[pull.request_id] = None
        return held

    def _end(self, pull: _Pull, result: PullStatus) -> None:
        """Every terminal result is set here, so none goes unannounced (a quarantined one once released)."""
        pull.sent_at, pull.result = None, result
        if self.close_blocks is not None and pull.generation is not None and self.close_blocks(
                pull.dst, pull.generation):
            pull.held = True
            self.quarantined += 1
            return
        self._finished[pull.request_id] = None

    def _forget(self, request_id: str) -> None:
        del self._pulls[request_id]
        self._finished.pop(request_id, None)

    @staticmethod
    def _timeout_error(pull: _Pull, ready_peers: set[str]) -> ConnectorError:
        if pull.peer not in ready_peers:
            return PeerUnavailable(f"pull of {pull.request_id!r}: prefill peer {pull.peer} did not "
                                   "complete the handshake before the deadline")
        return PullTimeout(f"pull of {pull.request_id!r}: prefill peer {pull.peer} did not report the "
                           "request finished before the deadline (unknown id, or prefill never done)")


def _hex(checksum: int | None) -> str:
    return "none" if checksum is None else f"{checksum:#010x}"
