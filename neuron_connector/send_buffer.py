"""The prefill side: serves decode peers' lookups and pushes finished requests' KV blocks."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from common.timeline import DECODE_DONE, PUBLISHED, PUSH_DONE, PUSH_STARTED, RELEASED, Timeline
from common.trace_spans import PUSH_SPAN, spans_of
from neuron_connector.channel import Delivery, Poller, RouterChannel, ServiceThread, new_context
from neuron_connector.errors import ConnectorError, ProtocolError
from neuron_connector.incarnation import new_incarnation, stale_lookup
from neuron_connector.lookup import Answer, InProgress, LookupTable, NotReady, Start
from neuron_connector.parked import ParkedLookups
from neuron_connector.protocol import (
    BAD_REQUEST, HANDSHAKE_REQUIRED, ErrorReply, Handshake, KVMapInit, LookupAll, LookupReply, Probe, Release,
    WriteBack, decode_request, request_fields)
from neuron_connector.pullers import Pullers
from neuron_connector.send_stats import Push, SendStats
from neuron_connector.session_gate import SessionGate
from neuron_connector.sessions import SessionTable
from transfer import CompletionToken, KVLayout, StaleHandoff, TransferError

log = logging.getLogger(__name__)

# Expiry period (blocks held / none). An ended push wakes the thread through its token's callback: polling
# running pushes would take the engine thread's GIL hundreds of times per slow (tcp) push.
_BUSY_POLL_S, _IDLE_POLL_S = 0.05, 1.0
_MAX_BATCH = 256         # messages handled per loop turn, so transfers are checked often
_CLOSE_FLUSH_S = 2.0     # closing waits this long at most for queued replies (a drained worker's last push's)


class SendBuffer:
    """The prefill worker's end of the signal plane: a ROUTER served by its own thread.

    The engine `publish`es a request when its prefill is done; a decode peer's `lookup_all` then queues the push of its
    blocks; `on_release(request_id)` is called from this buffer's thread once the blocks may be freed (pulled, failed,
    discarded, released by the decode peer whose request is gone or whose session is lost, or expired),
    `on_transfer(seconds, num_blocks)` once for every push that completed, and `on_write_back(offer)` for each
    finished answer's KV a decode peer offers (given it, the handshake says this side takes write-backs). A lookup
    that asks for a checksum gets the one the push computed over the bytes it sent (in the copy's pass over shm, on
    the transfer thread otherwise: never on this buffer's thread). A push never runs past `transfer_timeout`, nor
    past the time the decode peer said it still waits, and writes only into blocks the peer still holds for the
    lookup's handoff (transfer.fences).

    Each decode connection is a session (`sessions.SessionTable`) bound to the engine id its handshake names; with a
    `secret` it is established only once the peer proved it holds the secret, and this side proves it back
    (`session_gate.SessionGate` answers the handshake and kv_map_init). A request
    whose decode engine (named by `expect`, or by its first lookup) lost its session or came back as another
    incarnation is released within seconds (`pullers.Pullers`); a lookup naming another life of either side than the
    one its request is held for is refused (`incarnation`)."""

    def __init__(self, transfer_engine: Any, layout: KVLayout, engine_id: str, bind_host: str,
                 kv_port: int, on_release: Callable[[str], None], abort_timeout: float = 60.0,
                 transfer_timeout: float = 30.0, on_transfer: Callable[[float, int], None] | None = None,
                 secret: bytes | None = None, timeline: Timeline | None = None,
                 on_write_back: Callable[[WriteBack], None] | None = None) -> None:
        self._engine = transfer_engine
        self.layout, self.engine_id = layout, engine_id
        self._bind = (bind_host, kv_port)
        self._on_release = on_release
        self._on_transfer = on_transfer
        self._on_write_back = on_write_back
        self._table = LookupTable(abort_timeout)
        self.transfer_timeout = transfer_timeout
        self._lock = threading.Lock()
        self._pullers = Pullers(max_age=abort_timeout)
        self._sessions = SessionTable(self._pullers.session_up, self._pullers.session_gone)  # only the thread's
        self._running: dict[str, Push] = {}                     # request id -> its running push
        self._parked: ParkedLookups[LookupAll] = ParkedLookups()  # lookups of requests not published yet
        self._service = ServiceThread()
        self._context = new_context()
        self._router: RouterChannel | None = None
        self._started_at, self.incarnation = 0.0, ""   # this life of the signal plane (neuron_connector.incarnation)
        self.stats = SendStats()
        self._gate = SessionGate(self._sessions, transfer_engine, layout, engine_id, secret, self.stats, self._alive)
        self.port = kv_port
        self.timeline = timeline if timeline is not None else Timeline("prefill")

    def start(self) -> None:
        """Binds the ROUTER (PeerUnavailable if the port is taken) and starts serving."""
        self._router = RouterChannel(self._context, *self._bind)
        self._started_at, self.incarnation = time.time(), new_incarnation()
        self.port = self._router.port
        self._service.start(self._serve, f"kv-send-{self.port}")

    def publish(self, request_id: str, block_ids: list[int], output_token: int | None) -> None:
        """Prefill finished: the blocks stay pinned until pulled, released by the decode peer
        (at once if it did so before) or `abort_timeout` passes. `output_token`: the first token,
        None when the engine does not know it yet (the decode peer then samples it itself).

        Raises DuplicateRequest for an id already published (the first entry stays), ConnectorError
        when the buffer is not serving, ValueError for bad block ids."""
        if not self._service.serving:
            raise ConnectorError("SendBuffer is not serving (call start(); not after close())")
        if not block_ids or any(b < 0 or b >= self.layout.num_blocks for b in block_ids):
            raise ValueError(f"block ids {list(block_ids)} empty or out of range [0, {self.layout.num_blocks})")
        with self._lock:
            self._table.publish(request_id, list(block_ids), output_token, time.monotonic())
        self.timeline.mark(request_id, PUBLISHED)
        self._service.wake()  # a held lookup of it is answered now (or, released already, its blocks freed)

    def expect(self, request_id: str, decode_engine_id: str) -> None:
        """The decode engine that will pull `request_id` (its prefill leg names it): should that engine
        lose its session here, the request's blocks are released within seconds."""
        with self._lock:
            self._pullers.expect(request_id, decode_engine_id, time.monotonic())

    def knows(self, request_id: str) -> bool:
        """Whether `publish(request_id, ...)` would be refused as a duplicate."""
        with self._lock:
            return self._table.known(request_id)

    def discard(self, request_id: str) -> None:
        """The engine aborted the request; a later lookup of it gets a terminal error."""
        with self._lock:
            self._table.discard(request_id, time.monotonic())
        self._service.wake()

    def pending(self) -> int:
        """Published requests whose blocks are still held."""
        with self._lock:
            return self._table.pending()

    def close(self) -> None:
        """Stops the thread and closes the socket; every block still held is released."""
        if not self._service.stop():
            return
        why = "the prefill worker's KV signal plane closed"
        with self._lock:
            self._table.release_all(why, time.monotonic())
            parked, _ = self._parked.take(lambda rid: True, time.monotonic())
        self._release_due()
        if self._router is not None:   # held lookups end now, not at their peer's deadline
            if parked:
                log.info("closing: answered %d held lookup(s) of requests never published here", len(parked))
            for held in parked:
                self._reply(held.identity, LookupReply(held.message.request_id, False, error=why).to_bytes())
            self._router.close(flush_s=_CLOSE_FLUSH_S)
        self._context.term()
        self._service.close()

    # --- the buffer's thread -------------------------------------------------------------

    def _serve(self) -> None:
        assert self._router is not None
        poller = Poller()
        poller.register(self._router)
        poller.register(self._service.waker)
        while not self._service.stopping:
            with self._lock:
                due = self._parked.next_due(time.monotonic())
                idle = not (self._table.pending() or self._running)
            ready = poller.poll((_IDLE_POLL_S if idle else _BUSY_POLL_S) if due is None
                                else max(0.0, min(_BUSY_POLL_S, due)))
            if self._service.waker in ready:
                self._service.waker.drain()
            if self._router in ready:
                self._drain_router()
            self._answer_parked()
            self._check_transfers()
            self._release_orphans()
            with self._lock:
                self._table.expire(time.monotonic())
            self._release_due()

    def _alive(self, routing_id: bytes) -> bool:
        """Probes a connection (a full queue means its peer is alive)."""
        assert self._router is not None
        return self._router.send(routing_id, Probe().to_bytes()) is not Delivery.PEER_GONE

    def _release_orphans(self) -> None:
        if self._pullers.probe_due(time.monotonic()):
            self._sessions.drop_gone(self._alive)
        with self._lock:
            orphans = self._pullers.orphans(time.monotonic())
            for rid, engine in orphans:
                self._table.release(rid, engine.encode(), time.monotonic())
        for rid, engine in orphans:
            self.stats.orphaned += 1
            log.warning("released request %s: decode engine %r, which was to pull it, lost its session", rid, engine)

    def _drain_router(self) -> None:
        assert self._router is not None
        for _ in range(_MAX_BATCH):
            message = self._router.recv()
            if message is None:
                return
            identity, payload = message
            if not identity:
                continue
            try:
                reply = self._handle(identity, payload)
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the plane
                log.exception("handling a message from %r failed", identity)
                kind, rid = request_fields(payload)
                reply = ErrorReply(f"internal error in {self.engine_id}: {exc}", BAD_REQUEST, kind, rid).to_bytes()
            if reply is not None:
                self._reply(identity, reply)

    def _reply(self, identity: bytes, reply: bytes) -> None:
        assert self._router is not None
        delivery = self._router.send(identity, reply)
        if delivery is Delivery.PEER_GONE:
            log.warning("dropped a reply to %s: its connection is gone", self._sessions.name(identity))
            self._sessions.drop(identity)
        elif delivery is Delivery.QUEUE_FULL:
            log.warning("dropped a reply to %s: its queue is full", self._sessions.name(identity))

    def _handle(self, identity: bytes, payload: bytes) -> bytes | None:
        try:
            message = decode_request(payload)
        except ProtocolError as exc:
            self.stats.bad_messages += 1
            kind, rid = request_fields(payload)
            return ErrorReply(str(exc), BAD_REQUEST, kind, rid).to_bytes()
        if isinstance(message, Handshake):
            return self._gate.handshake(identity, message, self._started_at, self.incarnation,
                                        self._on_write_back is not None).to_bytes()
        if isinstance(message, KVMapInit):
            return self._gate.kv_map_init(identity, message).to_bytes()
        if isinstance(message, (Release, WriteBack)):
            self._notice(identity, message)
            return None
        reply = self._lookup(identity, message)
        return None if reply is None else reply.to_bytes()

    def _answer_parked(self) -> None:
        """Held lookups whose request is published now are handled; those held long enough get "not ready"."""
        with self._lock:
            ready, expired = self._parked.take(self._table.ready, time.monotonic())
        for parked in ready:
            if (reply := self._lookup(parked.identity, parked.message)) is not None:
                self._reply(parked.identity, reply.to_bytes())
        for parked in expired:
            self._reply(parked.identity, LookupReply(parked.message.request_id, False).to_bytes())

    def _lookup(self, routing_id: bytes, message: LookupAll) -> LookupReply | ErrorReply | None:
        rid, identity = message.request_id, routing_id
        self.stats.lookups += 1
        session = self._sessions.established(identity)
        if session is None:
            # A new connection (this worker or the peer restarted, or it reconnected), or a peer
            # that never authenticated: it must complete the handshake first.
            return ErrorReply(f"connection {identity.hex()} has not completed the handshake",
                              HANDSHAKE_REQUIRED, LookupAll.TYPE, rid)
        peer, identity = session.transfer_peer, session.engine_id.encode()   # the table knows peers by engine id
        with self._lock:
            bound = self._pullers.bound_elsewhere(rid, session.engine_id, session.incarnation)
            if (refusal := stale_lookup(message, self.incarnation, self.engine_id, session.engine_id, bound)):
                self.stats.stale_lookups += 1
                return refusal
            decision = self._table.lookup(rid, identity, message.block_ids_in_peer_device, message.skipped_blocks)
            if isinstance(decision, (NotReady, Start)):
                self._pullers.looked_up(rid, session.engine_id, time.monotonic(), session.incarnation)
        if isinstance(decision, NotReady):
            self.stats.not_ready += 1
            with self._lock:
                self._parked.park(rid, routing_id, message, time.monotonic(), message.timeout_s)
            return None
        if isinstance(decision, Answer):
            return decision.reply
        if isinstance(decision, InProgress):
            return None
        timeout = min(self.transfer_timeout, message.timeout_s or self.transfer_timeout)
        if (spans := spans_of(self.timeline)) is not None:
            spans.join(rid, PUSH_SPAN, message.traceparent)  # the push goes under the decode worker's pull
        return self._start(rid, peer, decision, timeout, message)

    def _notice(self, identity: bytes, message: Release | WriteBack) -> None:
        """Taken only from an established session: a decode peer is done with a request (its KV pulled, or the
        request gone: the release goes out at the end of this loop turn), or it offers a finished answer's KV for
        `on_write_back` (none: the peer, told in the handshake that we take none, frees it later)."""
        rid = message.request_id
        self.stats.peer_releases += isinstance(message, Release) and not message.pulled
        session = self._sessions.established(identity)
        if session is None:
            self.stats.unauthorized += 1
            log.warning("ignored a %s of %s from %s, which has not completed the handshake", message.TYPE, rid,
                        self._sessions.name(identity))
        elif isinstance(message, WriteBack):
            self.stats.write_backs_offered += 1
            if self._on_write_back is not None:
                self._service.call(self._on_write_back, message)
        else:
            with self._lock:
                accepted = message.pulled or self._table.release(rid, session.engine_id.encode(), time.monotonic())
            if accepted:
                self.timeline.mark(rid, DECODE_DONE)
            else:
                log.warning("%s released request %s, which another decode peer is pulling: ignored",
                            session.describe(), rid)

    def _start(self, rid: str, peer: Any, start: Start, timeout: float, lookup: LookupAll) -> LookupReply | None:
        token, started, checksum = CompletionToken(), time.monotonic(), lookup.checksum is not None
        try:  # with a generation the push writes only into blocks the peer still holds for it (transfer.fences)
            self._engine.queue_transfer_with_token(peer, list(start.src), list(start.dst), token, timeout=timeout,
                                                   checksum=checksum, generation=lookup.generation)
        except (TransferError, ConnectorError, ValueError) as exc:
            done = self._transfer_done(rid, f"transfer of {rid!r} could not start: {exc}")
            return None if done is None else done[1]
        self.timeline.mark(rid, PUSH_STARTED)
        self._running[rid] = Push(token, started, len(start.src), checksum, lookup.generation)
        token.add_done_callback(lambda _: self._pushed(rid))
        return None

    def _pushed(self, rid: str) -> None:
        """A push ended (called on the transfer's thread): timed, and this thread woken to answer."""
        self.timeline.mark(rid, PUSH_DONE)
        self._service.wake()

    def _check_transfers(self) -> None:
        assert self._router is not None
        for rid, push in list(self._running.items()):
            if not push.token.is_done():
                continue
            del self._running[rid]
            try:
                push.token.wait(0)
                error = None
            except TransferError as exc:
                error = f"transfer of {rid!r} failed: {exc}"
                self.stats.stale_pushes += isinstance(exc, StaleHandoff)
                self.timeline.fail(rid, error)
            if error is None and self._on_transfer is not None:
                self._service.call(self._on_transfer, time.monotonic() - push.started, push.num_blocks)
            done = self._transfer_done(rid, error, push.token.checksum if push.summed else None)
            if done is None:
                continue
            identity = self._sessions.routing_id_of(done[0].decode())
            if identity is None:
                log.warning("decode engine %r left before the reply for %s", done[0].decode(), rid)
            else:
                self._reply(identity, replace(done[1], generation=push.generation).to_bytes())

    def _transfer_done(self, rid: str, error: str | None,
                       checksum: int | None = None) -> tuple[bytes, LookupReply] | None:
        if error is None:
            self.stats.transfers_ok += 1
        else:
            self.stats.transfers_failed += 1
            log.warning("%s", error)
        with self._lock:
            return self._table.transfer_done(rid, error, time.monotonic(), checksum)

    def _release_due(self) -> None:
        with self._lock:
            released = self._table.take_releases()
            self._pullers.forget(released)
        for rid in released:
            self.stats.released += 1
            self.timeline.mark(rid, RELEASED)
            self._service.call(self._on_release, rid)

