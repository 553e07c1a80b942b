"""The decode side: one DEALER per prefill peer, owned by the buffer's own thread."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from common.pid import pid_alive
from common.timeline import LOOKUP_ANSWERED, PULL_STARTED, Timeline
from common.trace_spans import LOOKUP_SPAN, spans_of
from common.tracing import TRACEPARENT
from neuron_connector.channel import DealerChannel, Poller, ServiceThread, new_context
from neuron_connector.errors import ConnectorError, HandshakeError, PeerUnavailable, ProtocolError
from neuron_connector.incarnation import new_incarnation
from neuron_connector.peer_link import LinkState, PeerLink
from neuron_connector.protocol import (
    CRC32C, HANDSHAKE_REQUIRED, ErrorReply, Handshake, HandshakeReply, KVMapInit, KVMapReply, LookupAll,
    LookupReply, Probe, Release, WriteBack, decode_reply)
from neuron_connector.pulls import PullStatus, PullTracker
from neuron_connector.verifier import PullVerifier
from transfer import KVLayout, TransferError
from transfer.fences import Fences, generations
from transfer.region import host_identity

log = logging.getLogger(__name__)

_MAX_POLL_S = 0.05     # while pulls or handshakes are under way
_IDLE_POLL_S = 1.0     # with none (new work wakes the thread): an idle worker stays idle


class RecvBuffer:
    """The decode worker's end of the signal plane.

    `request_pull` registers a pull of a request's KV blocks from a prefill peer into our
    blocks `dst_block_ids`; the buffer's thread connects to that peer on demand (one
    DEALER per peer, kept in `connection_dict`), handshakes, and sends `lookup_all` with
    backoff until the peer pushed the blocks or the deadline passed. `poll` never waits.
    `on_finished(request_id)` is called from the buffer's thread, once, when a pull turns
    DONE or FAILED, so the caller knows which id to `poll` without polling every pull (if
    `poll` reported it meanwhile, polling it again raises UnknownRequest; a pull `cancel`
    forgot is not named). A request that ends here before its pull did (`cancel`, a
    timeout, or `release` for one never pulled) is released on its peer, which then frees
    the request's blocks at once instead of at its abort timeout.

    `max_backoff` bounds the wait between "not finished yet" and the next lookup (it is the
    worst extra latency after the prefill finishes); an unanswered lookup is resent after
    `resend_after`; a pull whose lookup is unanswered at its deadline waits `grace` more
    seconds for the answer, since the peer may be writing into our blocks.

    `engine_id` names this decode engine in every handshake: a prefill peer refuses it
    (EngineIdInUse) while another live decode worker holds it, so it must be unique. With
    a `secret`, both sides prove they hold it (Unauthorized otherwise).

    With `integrity_check` (the default), every lookup asks the peer for a CRC-32C of the
    blocks it sends, and a pull turns DONE only once the same checksum over our blocks
    matches; otherwise it fails with IntegrityError (and our blocks are free to reuse, as
    after any failure). Our checksum is summed on a thread of its own (neuron_connector.verifier),
    as the push lands the bytes, so a large pull never holds up the signal plane and its check
    overlaps its copy.

    Every pull is a handoff with a fresh generation (transfer.fences): its blocks are opened for it
    before its first lookup, and closed when it ends. The prefill's push writes only into blocks open
    for the generation its lookup named, so a push that comes late (a prefill frozen past the
    heartbeat, resumed after we failed the pull and reused the blocks) writes nothing; a pull ended
    while its writer is mid-write stays PENDING until the writer lets go (`quarantined` counts them);
    a reply naming an older generation is dropped (`stale_replies`).
    """

    def __init__(self, transfer_engine: Any, layout: KVLayout, engine_id: str,
                 default_timeout: float = 30.0, resend_after: float = 1.0, grace: float = 5.0,
                 max_backoff: float = 0.02, on_finished: Callable[[str], None] | None = None,
                 secret: bytes | None = None, integrity_check: bool = True,
                 timeline: Timeline | None = None) -> None:
        self._engine = transfer_engine
        self.timeline = timeline if timeline is not None else Timeline("decode")
        self.layout = layout
        self.engine_id = engine_id
        self._secret = secret
        self.default_timeout = default_timeout
        self._resend_after = resend_after
        self._pulls = PullTracker(resend_after=resend_after, grace=grace, max_backoff=max_backoff,
                                  checksum=CRC32C if integrity_check else None, close_blocks=self._close_blocks,
                                  reclaim_blocks=self._reclaim_blocks)
        self._generations = generations()
        self.incarnation = new_incarnation()   # this life of our signal plane, named in every handshake
        self._verifier = PullVerifier(transfer_engine, f"kv-verify-{engine_id}", self._verified, layout.block_bytes) \
            if integrity_check else None
        self._links: dict[str, PeerLink] = {}
        self.connection_dict: dict[str, DealerChannel] = {}   # only touched by the thread
        self._on_finished = on_finished
        self._lock = threading.Lock()
        self._service = ServiceThread()
        self._context = new_context()

    def start(self) -> None:
        if self._verifier is not None:
            self._verifier.start()
        self._service.start(self._serve, f"kv-recv-{self.engine_id}")

    def maybe_setup_buffer(self, peer_host: str, peer_kv_port: int) -> str:
        """Makes sure a link to the peer exists (created on demand); returns its address."""
        address = f"{peer_host}:{peer_kv_port}"
        with self._lock:
            self._link_to(address)
        self._service.wake()
        return address

    def _link_to(self, address: str) -> None:
        """A link to `address` that has not failed, made anew if it had (the lock held)."""
        link = self._links.get(address)
        if link is None or link.state is LinkState.FAILED:
            self._links[address] = PeerLink(address, self.engine_id, self.layout.to_dict(), self._descriptor(),
                                            self._secret, self._resend_after, incarnation=self.incarnation)

    def _descriptor(self) -> dict[str, Any]:
        try:
            return self._engine.descriptor()
        except TransferError as exc:
            raise HandshakeError(f"our transfer engine cannot describe its KV pool: {exc}") from exc

    def request_pull(self, request_id: str, peer_host: str, peer_kv_port: int, dst_block_ids: list[int],
                     deadline_s: float | None = None, peer_engine_id: str | None = None,
                     skipped_blocks: int | None = None) -> None:
        """Starts pulling; `deadline_s` (default `default_timeout`) bounds the whole pull.

        `skipped_blocks`: the request's leading blocks we hold already (our prefix cache);
        `dst_block_ids` then receive exactly the blocks after them. None: the peer's last
        len(dst_block_ids) blocks.

        With `peer_engine_id`, the pull fails with EngineMismatch when the peer's handshake
        names another engine, instead of pulling from whatever worker now has that address.
        """
        if not self._service.serving:
            raise ConnectorError("RecvBuffer is not running (call start())")
        if any(b < 0 or b >= self.layout.num_blocks for b in dst_block_ids):
            raise ValueError(f"block ids {dst_block_ids} out of range [0, {self.layout.num_blocks})")
        if skipped_blocks is not None and skipped_blocks < 0:
            raise ValueError(f"skipped_blocks must not be negative, got {skipped_blocks}")
        address = self.maybe_setup_buffer(peer_host, peer_kv_port)   # raises before anything is marked
        now = time.monotonic()
        timeout = self.default_timeout if deadline_s is None else deadline_s
        self.timeline.mark(request_id, PULL_STARTED)  # first: a traced pull's span is open for its lookup to name
        spans = spans_of(self.timeline)
        traceparent = spans.headers(request_id, LOOKUP_SPAN).get(TRACEPARENT) if spans is not None else None
        fences = self._fences()
        with self._lock:
            # Again, with the pull under the same hold of the lock: a link that failed since would fail only the
            # pulls it had, and leave this one to wait out its deadline.
            self._link_to(address)
            generation = None if fences is None else next(self._generations)
            self._pulls.add(request_id, address, list(dst_block_ids), now + timeout, now, peer_engine_id,
                            skipped_blocks, traceparent, generation)
            if fences is not None and generation is not None:
                fences.open(dst_block_ids, generation)   # before the first lookup can name it
        if self._verifier is not None and generation is not None:
            self._verifier.watch(request_id, dst_block_ids)
        self._service.wake()

    @property
    def stale_replies(self) -> int:
        """Replies dropped because they answered a handoff generation that is not the pull's."""
        return self._pulls.stale_replies

    @property
    def quarantined(self) -> int:
        """Pulls that ended while their writer still held their blocks (freed once it let go)."""
        return self._pulls.quarantined

    @property
    def fence_counts(self) -> tuple[int, int]:
        """(pulls whose blocks a handoff fence guarded, pulls failed because another incarnation answered)."""
        return self._pulls.fenced, self._pulls.other_incarnation

    def _fences(self) -> Fences | None:
        return getattr(self._engine, "fences", None)

    def _close_blocks(self, blocks: tuple[int, ...], generation: int) -> int:
        fences = self._fences()
        return 0 if fences is None else fences.close(blocks, generation)

    def _reclaim_blocks(self, blocks: tuple[int, ...], generation: int) -> None:
        if (fences := self._fences()) is not None:
            log.warning("reclaimed blocks %s: the process writing them died mid-write", list(blocks))
            fences.reclaim(blocks, generation)

    def poll(self, request_id: str) -> PullStatus:
        """PENDING, DONE(output_token) or FAILED(error); terminal states are reported once."""
        with self._lock:
            return self._pulls.poll(request_id)

    def cancel(self, request_id: str) -> bool:
        """Stops a pull, and tells its peer to release the request unless the pull had ended.
        True: our blocks are free now. False: the peer may be writing into them; `poll`
        reports FAILED once they are safe to reuse."""
        with self._lock:
            free = self._pulls.cancel(request_id)
        if self._verifier is not None:
            self._verifier.forget([request_id])
        self._service.wake()
        return free

    def release(self, request_id: str, peer_host: str, peer_kv_port: int) -> None:
        """Tells the peer that a request we never pulled is gone (say, aborted while it waited
        for blocks), so it frees the request's blocks now or when it publishes them, not at
        its abort timeout. For a request with a pull, `cancel` does this."""
        self._notify(peer_host, peer_kv_port, Release(request_id))

    def takes_write_backs(self, peer_host: str, peer_kv_port: int) -> bool:
        """Whether the peer's handshake (done: we pulled from it) said it pulls the answers' KV we offer."""
        with self._lock:
            link = self._links.get(f"{peer_host}:{peer_kv_port}")
            return link is not None and link.info is not None and link.info.takes_write_backs

    def write_back(self, peer_host: str, peer_kv_port: int, offer: WriteBack) -> None:
        """Offers the peer (the prefill worker that served a finished request) that answer's KV, which waits on
        our hand-back plane for its pull."""
        self._notify(peer_host, peer_kv_port, offer)

    def _notify(self, peer_host: str, peer_kv_port: int, notice: Release | WriteBack) -> None:
        """Queues `notice` for the peer: sent once its session is up, dropped with the peer if it fails."""
        if not self._service.serving:
            raise ConnectorError("RecvBuffer is not running (call start())")
        address = self.maybe_setup_buffer(peer_host, peer_kv_port)
        with self._lock:
            self._pulls.notify(address, notice)
        self._service.wake()

    def close(self) -> None:
        """Stops the thread and closes every DEALER; idempotent."""
        if not self._service.stop():
            return
        for channel in self.connection_dict.values():
            channel.close()
        self.connection_dict.clear()
        self._context.term()
        if self._verifier is not None:   # before the waker it wakes is closed
            self._verifier.close()
        self._service.close()

    # --- the buffer's thread -------------------------------------------------------------

    def _serve(self) -> None:
        poller = Poller()
        poller.register(self._service.waker)
        while not self._service.stopping:
            self._sync_channels(poller)
            self._send_due()
            with self._lock:
                busy = len(self._pulls) > 0 or any(not link.ready for link in self._links.values())
                timeout = min(_MAX_POLL_S if busy else _IDLE_POLL_S, self._pulls.next_event(time.monotonic()))
            for item in poller.poll(timeout):
                if item is self._service.waker:
                    self._service.waker.drain()
                else:
                    self._drain(item)  # type: ignore[arg-type]
            with self._lock:
                ready = {a for a, link in self._links.items() if link.ready}
                self._pulls.expire(time.monotonic(), ready)
                self._pulls.unhold(pid_alive)
                finished = self._pulls.take_finished()
            self._announce(finished)

    def _announce(self, finished: list[str]) -> None:
        if self._verifier is not None:
            self._verifier.forget(finished)
        if self._on_finished is None:
            return
        for request_id in finished:
            self._service.call(self._on_finished, request_id)

    def _sync_channels(self, poller: Poller) -> None:
        """Opens a DEALER per linked peer."""
        with self._lock:
            wanted = [a for a in self._links if a not in self.connection_dict]
        for address in wanted:
            host, port = address.rsplit(":", 1)
            try:
                channel = DealerChannel(self._context, host, int(port))
            except PeerUnavailable as exc:
                with self._lock:
                    self._links[address].fail(exc)
                    self._pulls.fail_peer(address, exc)
                continue
            self.connection_dict[address] = channel
            poller.register(channel)

    def _send_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            ready = {a for a, link in self._links.items() if link.ready}
            lookups = [(a, m.to_bytes()) for a, m in self._pulls.due(now, ready)]
            for address in self._pulls.take_stale_peers():
                self._links[address].reset()     # its handshake goes out below
            outgoing = [(a, m) for a, link in self._links.items()
                        if a in self.connection_dict and (m := link.due(now)) is not None]
            outgoing += lookups
            # The peer takes a release or a write-back only from an established (authenticated) session.
            outgoing += [(a, m.to_bytes()) for a, m in self._pulls.take_notices(ready)]
        for address, payload in outgoing:
            self.connection_dict[address].send(payload)

    def _drain(self, channel: DealerChannel) -> None:
        """The replies the peer sent, then its lost connection, if lost: a peer that answered and exited
        (a drained prefill worker's last push) has its answers taken first, so those pulls end as answered."""
        address = channel.address
        now = time.monotonic()
        state = channel.connection_state(now)
        self._take_replies(channel)
        if state.lost:
            with self._lock:
                if (link := self._links.get(address)) is not None:
                    link.reset()     # whoever answers there next is asked who it is
                failed = self._pulls.peer_lost(address)
            log.warning("lost the connection to prefill peer %s: %d pull(s) from it failed", address, failed)
        if state.failing_since is not None:
            with self._lock:
                failed = self._pulls.peer_unreachable(address, state.failing_since, now)
            if failed:
                log.warning("prefill peer %s refuses or does not answer connections: %d pull(s) from it failed",
                            address, failed)

    def _take_replies(self, channel: DealerChannel) -> None:
        address = channel.address
        while (payload := channel.recv()) is not None:
            try:
                reply = decode_reply(payload)
            except ProtocolError as exc:
                log.warning("bad reply from %s: %s", address, exc)
                continue
            if (self._verifier is not None and isinstance(reply, LookupReply) and reply.success
                    and reply.checksum is not None):
                with self._lock:
                    self._pulls.answered(reply.request_id)
                self._verifier.verify(address, reply)
                continue
            with self._lock:
                answer = self._handle(address, reply)
            if answer is not None:
                channel.send(answer)

    def _handle(self, address: str, reply: Any, local_checksum: int | None = None) -> bytes | None:
        try:
            return self._on_reply(address, reply, local_checksum)
        except Exception:  # noqa: BLE001 - one bad reply must not stop every pull
            log.exception("handling a reply from %s failed", address)
            return None

    def _verified(self, address: str, reply: LookupReply, local: int | None) -> None:
        """On the verifier's thread: hands the reply on with our checksum of its blocks."""
        with self._lock:
            self._handle(address, reply, local)
        self._service.wake()

    def _on_reply(self, address: str, reply: Any, local_checksum: int | None = None) -> bytes | None:
        link, now = self._links.get(address), time.monotonic()
        if link is None:
            return None
        if isinstance(reply, Probe):
            return None
        if isinstance(reply, LookupReply):
            if reply.success:
                self.timeline.mark(reply.request_id, LOOKUP_ANSWERED)
            self._pulls.on_reply(reply, now, local_checksum)
        elif isinstance(reply, ErrorReply) and reply.code == HANDSHAKE_REQUIRED:
            link.reset()
            self._pulls.resend_peer(address)
        elif isinstance(reply, HandshakeReply) or (isinstance(reply, ErrorReply)
                                                   and reply.reply_to == Handshake.TYPE):
            answer = link.on_handshake(reply, now)
            if link.error is not None:
                self._pulls.fail_peer(address, link.error)
            return answer
        elif isinstance(reply, KVMapReply) or (isinstance(reply, ErrorReply)
                                                and reply.reply_to == KVMapInit.TYPE):
            was_ready = link.ready
            link.on_kv_map(reply)
            if link.error is not None:
                self._pulls.fail_peer(address, link.error)
            elif link.ready and not was_ready and link.info is not None:
                transfer = link.info.transfer
                writer = transfer.get("pid") if transfer.get("host_id") == host_identity() else None
                self._pulls.peer_ready(address, link.info.engine_id, writer if isinstance(writer, int) else None,
                                       link.info.incarnation)
        elif isinstance(reply, ErrorReply) and reply.reply_to == LookupAll.TYPE and reply.request_id:
            self._pulls.on_reply(LookupReply(reply.request_id, False, error=reply.message), now)
        else:
            log.warning("unexpected reply from %s: %r", address, reply)
        return None
