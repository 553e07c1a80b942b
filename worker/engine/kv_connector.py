"""The engine's side of disaggregated serving: a small adapter over neuron_connector and transfer.

The engine calls it from its one thread. On a prefill worker it publishes each finished
`remote_kv` request's blocks with a SendBuffer and reports the releases the SendBuffer's
thread announces (pulled, failed, or not pulled within the abort timeout). On a decode
worker it starts a pull into each admitted request's fresh blocks with a RecvBuffer and
reports the pulls its thread announces as finished: "done with first token t" or "failed
with this error". Either buffer's announcement also calls `wake`, so an idle engine thread
steps at once instead of polling.

With `write_back` ("chats": answers to chats under way; "all": every answer) a decode worker offers the prefill
worker that served a finished request the KV of its prompt and answer (held on its hand-back plane), and that
prefill worker (any mode but "off") pulls it with a RecvBuffer of its own (worker/engine/kv_write_back.py).
"""
from __future__ import annotations

import logging
import queue
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

from common.handoff import DecodeParams, PrefillHandoff
from common.kv_secret import describe_plane
from common.roles import DEFAULT_KV_PORT
from common.timeline import ADMITTED, FIRST_STEP, PULL_REPORTED, Timeline
from neuron_connector import (ConnectorError, EngineMismatch, HandshakeError, IntegrityError, ProtocolError,
                              PullState, RecvBuffer, SendBuffer, UnknownRequest, WriteBack)
from transfer import KVLayout, TransferError, create_transfer_engine
from common.held_blocks import HeldBlocks
from worker.config import WRITE_BACK_MODES
from worker.errors import KVTransferError

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class KVConnectorConfig:
    """How a prefill or decode worker moves KV: transport, signal-plane address and timeouts."""

    role: str                              # "prefill" | "decode"
    transport: str = "auto"
    kv_host: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT         # prefill's ROUTER; 0 = a free port
    engine_id: str = ""                    # signal-plane id; "" = the transfer engine's transfer_id
    abort_timeout: float = 60.0            # prefill: free blocks nobody pulled after this long
    pull_timeout: float = 30.0             # decode: fail a pull not done after this long
    integrity_check: bool = True           # decode: verify every pull with a CRC-32C the prefill sends
    hand_back_port: int | None = None      # decode: serve handed-back streams' and written-back answers' KV here
                                           # (0 = a free port); None: a free one with write-back, else none
    hand_back_timeout: float = 3.0         # decode: free a handed-back stream's KV nobody pulled after this long
    write_back: str = "off"                # decode: which finished answers' KV to offer their prefill worker
                                           # (WRITE_BACK_MODES); prefill: any but "off" takes them
    secret: bytes | None = field(default=None, repr=False)   # the shared KV secret; None: unauthenticated

    def __post_init__(self) -> None:
        if self.write_back not in WRITE_BACK_MODES:
            raise ValueError(f"write_back must be one of {', '.join(WRITE_BACK_MODES)}, got {self.write_back!r}")

    @property
    def writes_back(self) -> bool:
        """Whether this worker takes part in write-back (offers answers' KV, or takes them)."""
        return self.write_back != "off"


@dataclass(slots=True)
class PullResults:
    """What one poll of the pending pulls found."""

    done: list[tuple[str, int]] = field(default_factory=list)            # (request id, first token)
    failed: list[tuple[str, KVTransferError]] = field(default_factory=list)


class KVConnector:
    """Owns the transfer engine, the KV pool region and the role's buffer thread."""

    def __init__(self, config: KVConnectorConfig) -> None:
        if config.role not in ("prefill", "decode"):
            raise ValueError(f"the KV connector serves roles prefill and decode, not {config.role!r}")
        self.config = config
        self.role = config.role
        self.timeline = Timeline(config.role)   # this worker's phases of each leg (GET /timeline)
        self.wake: Callable[[], None] = lambda: None   # set by the engine's driver thread
        # Prefill: called from the SendBuffer thread with (seconds, blocks, bytes) per completed push.
        self.on_transfer: Callable[[float, int, int], None] = lambda seconds, blocks, nbytes: None
        # Decode with integrity_check: called from take_finished with the outcome of each verified pull.
        self.on_integrity_check: Callable[[bool], None] = lambda ok: None
        # Decode: called from the engine thread per finished pull with (blocks pulled, blocks skipped, block bytes).
        self.on_pull: Callable[[int, int, int], None] = lambda pulled, skipped, block_bytes: None
        self._block_bytes = 0
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.held = HeldBlocks()   # prefill: the block sets published and not released yet
        self._finished: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._write_backs: queue.SimpleQueue[WriteBack] = queue.SimpleQueue()
        self._transfer: Any = None
        self.engine_id = config.engine_id              # the transfer engine's transfer_id if "", once allocated
        self.send: SendBuffer | None = None
        self.recv: RecvBuffer | None = None

    @property
    def kv_port(self) -> int:
        """The signal plane's bound port (prefill), once the pool is allocated."""
        return self.send.port if self.send is not None else self.config.kv_port

    def allocate_pool(self, layout: KVLayout) -> torch.Tensor:
        """The engine's KV pool, registered with the transfer engine; starts the buffer thread."""
        cfg = self.config
        try:
            self._transfer = create_transfer_engine(cfg.transport, host=cfg.kv_host, secret=cfg.secret)
            pool = self._transfer.allocate_region(layout)
            self._block_bytes = layout.block_bytes
            engine_id = self.engine_id = cfg.engine_id or self._transfer.transfer_id  # unique: one session per id
            decode = self.role == "decode"
            hand_back_port = 0 if cfg.hand_back_port is None and cfg.writes_back else cfg.hand_back_port
            if not decode or hand_back_port is not None:
                self.send = SendBuffer(self._transfer, layout, engine_id, cfg.kv_host,
                                       hand_back_port if decode else cfg.kv_port, on_release=self._on_release,
                                       abort_timeout=cfg.hand_back_timeout if decode else cfg.abort_timeout,
                                       transfer_timeout=cfg.pull_timeout,
                                       on_transfer=lambda seconds, blocks: self.on_transfer(
                                           seconds, blocks, blocks * layout.block_bytes), secret=cfg.secret,
                                       timeline=self.timeline,
                                       on_write_back=self._on_write_back if cfg.writes_back and not decode else None)
                self.send.start()
            if decode or cfg.writes_back:
                self.recv = RecvBuffer(self._transfer, layout, engine_id, default_timeout=cfg.pull_timeout,
                                       on_finished=self._on_finished, secret=cfg.secret,
                                       integrity_check=cfg.integrity_check, timeline=self.timeline)
                self.recv.start()
        except (TransferError, ConnectorError) as exc:
            self.close()
            raise KVTransferError(f"KV connector ({cfg.transport}) failed to start: {exc}") from exc
        logger.info("%s", describe_plane(cfg.kv_host, self.send.port if self.send is not None else None,
                                         self._transfer.descriptor()["transports"], cfg.secret))
        return pool

    # ---- prefill ------------------------------------------------------------------------------

    def publish(self, request_id: str, block_ids: list[int], output_token: int) -> None:
        assert self.send is not None
        new = self.held.hold(request_id, len(block_ids))
        try:
            self.send.publish(request_id, block_ids, output_token)
        except BaseException:
            if new:  # a duplicate leaves the first one held
                self.held.release(request_id)
            raise

    def handoff(self, request_id: str) -> PrefillHandoff:
        """Prefill: where a decode worker pulls `request_id`'s blocks from (the kv_transfer_params of the answer)."""
        return PrefillHandoff(self.config.kv_host, self.kv_port, self.engine_id, request_id)

    def remembers(self, request_id: str) -> bool:
        """Prefill: the id is still published, or remembered so a late lookup of it gets its answer."""
        return self.send is not None and self.send.knows(request_id)

    def discard(self, request_id: str) -> None:
        """Prefill: the request is gone (or nobody will pull it): its blocks are released (once a running push
        ends), its decode peer's lookup fails at once, and a leg with its id that arrives later is refused."""
        if self.send is not None:
            self.send.discard(request_id)

    def _on_write_back(self, offer: WriteBack) -> None:
        # SendBuffer thread: as _on_release.
        self._write_backs.put(offer)
        self.wake()

    def has_write_backs(self) -> bool:
        """Prefill: whether offers wait to be taken."""
        return not self._write_backs.empty()

    def take_write_backs(self) -> list[WriteBack]:
        """Prefill: the answers' KV decode workers offered since the last call."""
        return _drain(self._write_backs)

    def _on_release(self, request_id: str) -> None:
        # SendBuffer thread: queue it for the engine thread and wake that thread up.
        self.held.release(request_id)
        self._released.put(request_id)
        self.wake()

    def take_released(self) -> list[str]:
        return _drain(self._released)

    # ---- decode -------------------------------------------------------------------------------

    def start_pull(self, request_id: str, target: DecodeParams, block_ids: list[int], num_skipped: int = 0,
                   timeout: float | None = None) -> None:
        """Pulls the request's blocks after its first `num_skipped` (which this worker holds) into `block_ids`,
        failing after `timeout` seconds (default: the configured pull timeout)."""
        assert self.recv is not None
        self.timeline.mark(request_id, ADMITTED)
        try:
            self.recv.request_pull(request_id, target.host, target.port, block_ids, deadline_s=timeout,
                                   peer_engine_id=target.engine_id, skipped_blocks=num_skipped)
        except (ConnectorError, ValueError) as exc:
            raise KVTransferError(f"KV pull of request {request_id!r} could not start: {exc}") from exc

    def pulled(self, request_id: str, num_pulled: int, num_skipped: int) -> None:
        """A finished pull runs in this step: counts the blocks it moved, and the leading blocks not moved
        since this worker held them."""
        self.timeline.mark(request_id, FIRST_STEP)
        self.on_pull(num_pulled, num_skipped, self._block_bytes)

    def admitted(self, request_id: str, decode_engine_id: str | None = None) -> None:
        """Prefill: a leg entered the engine; `decode_engine_id` will pull its KV (freed soon after that engine's
        session here is lost)."""
        self.timeline.mark(request_id, ADMITTED)
        if decode_engine_id is not None and self.send is not None:
            self.send.expect(request_id, decode_engine_id)

    def _on_finished(self, request_id: str) -> None:
        # RecvBuffer thread: as _on_release.
        self._finished.put(request_id)
        self.wake()

    def take_finished(self) -> PullResults:
        """The pulls that ended since the last call; never blocks."""
        results = PullResults()
        for request_id in _drain(self._finished):
            assert self.recv is not None
            try:
                status = self.recv.poll(request_id)
            except UnknownRequest:  # cancelled after it ended: its blocks were freed then
                continue
            self.timeline.mark(request_id, PULL_REPORTED)
            if status.state is PullState.DONE and status.output_token is None:
                results.failed.append((request_id, KVTransferError(
                    f"KV transfer of request {request_id!r} from the prefill worker failed: it sent no first "
                    "token (a prefill worker of another engine?)", retryable=False)))
            elif status.state is PullState.DONE:
                results.done.append((request_id, status.output_token))
                if self.config.integrity_check:
                    self.on_integrity_check(True)
            elif status.state is PullState.FAILED:
                self.timeline.fail(request_id, status.message or "the pull failed")
                if isinstance(status.error, IntegrityError):
                    self.on_integrity_check(False)
                results.failed.append((request_id, KVTransferError(
                    f"KV transfer of request {request_id!r} from the prefill worker failed: {status.message}",
                    retryable=_retryable(status.error))))
        return results

    def cancel(self, request_id: str) -> bool:
        """Stops a pull; True if its blocks may be freed now, else take_finished() reports it failed later.
        Either way the prefill worker is told to free the request's blocks."""
        return self.recv is None or self.recv.cancel(request_id)

    def takes_write_backs(self, target: DecodeParams) -> bool:
        """Decode: whether `target`, a prefill worker we pulled from, pulls the answers' KV we offer it (its
        handshake says so: a worker without write-back, or a `vllm serve` one, does not)."""
        return self.recv is not None and self.recv.takes_write_backs(target.host, target.port)

    def offer_write_back(self, request_id: str, target: DecodeParams, token_ids: list[int]) -> None:
        """Decode: tells `target` (the prefill worker a finished request was pulled from) that the KV of
        `token_ids` but the last waits, published as `request_id`, on this worker's hand-back plane."""
        assert self.recv is not None and self.send is not None
        offer = WriteBack(request_id, self.config.kv_host, self.send.port, self.engine_id, tuple(token_ids))
        try:
            self.recv.write_back(target.host, target.port, offer)
        except ConnectorError as exc:
            raise KVTransferError(f"could not offer {target.host}:{target.port} the KV of {request_id}: {exc}") \
                from exc

    def release(self, request_id: str, target: DecodeParams) -> None:
        """A request that never started its pull is gone: its prefill worker may free the blocks now."""
        if self.recv is None:
            return
        try:
            self.recv.release(request_id, target.host, target.port)
        except ConnectorError:  # the signal plane is down: the prefill's abort timeout frees them
            logger.warning("could not tell prefill %s:%s to release %s", target.host, target.port, request_id,
                           exc_info=True)

    def close(self) -> None:
        for buffer in (self.send, self.recv):
            if buffer is not None:
                buffer.close()
        self.send = self.recv = None
        if self._transfer is not None:
            try:
                self._transfer.close()
            except Exception:  # noqa: BLE001 - shutting down: log and go on releasing the rest
                logger.exception("closing the transfer engine failed")
            self._transfer = None


def _retryable(error: ConnectorError | None) -> bool:
    """Whether the request sent again may succeed: not when the peer refuses our layout or breaks the protocol
    (every retry would fail alike), yes when it was slow, unreachable, restarted or forgot the request."""
    return isinstance(error, EngineMismatch) or not isinstance(error, (HandshakeError, ProtocolError))


def _drain(items: queue.SimpleQueue[T]) -> list[T]:
    taken: list[T] = []
    while True:
        try:
            taken.append(items.get_nowait())
        except queue.Empty:
            return taken
