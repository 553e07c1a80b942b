"""A finished answer's KV written back to the prefill worker that served its prompt (`--kv-write-back`: by default
the answers to chats whose messages hold an answer already, a conversation under way; `all`: every answer).

In a chat, the next turn's prompt is this turn's prompt, its answer and a new message. The prefill worker
holds the prompt's KV, but the answer's exists only on the decode worker that generated it, so the next
turn's prefill computes the answer again. With write-back, a decode worker that finishes a request it pulled
from a prefill worker (stop or length) holds the full blocks of its prompt and answer (its prefix cache has
them: each step commits what it computed) on its hand-back signal plane, and offers them to that prefill
worker over the session the pull used (`WriteBack`). The prefill worker pulls the blocks it lacks over the
transfer engine (fences, checksum and timeout as for any pull) into blocks of its own and adds them to its
prefix cache, which publishes `BlockStored`: KV-aware routing then sends the next turn there, and its
prefill computes the new message only.

A chat's next turn often reaches the prefill worker as the write-back of its last answer is still being
pulled: a waiting prompt that extends a write-back in flight (and the queue behind it) waits for that pull,
at most `HOLD_S`, so that it computes only its new tokens.

A decode worker offers only to a prefill worker whose handshake said it takes write-backs (one with
`--kv-write-back off`, or a `vllm serve` one, is offered nothing). Write-back is bounded: the prefill worker
takes an offer only while at most `MAX_PULLS` are in flight and half its pool stays free, and fails a pull
not done within `PULL_TIMEOUT_S`; the decode worker offers only while its held blocks stay under a quarter
of its pool. Whatever is refused, fails or is not pulled in time frees its blocks on both sides (the decode
worker's at its hand-back timeout at the latest).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.handoff import DecodeParams
from neuron_connector import ConnectorError, WriteBack
from scheduler import Sequence
from worker.engine.kv_connector import KVConnector
from worker.engine.request import Request
from worker.errors import KVTransferError

if TYPE_CHECKING:
    from worker.engine.roles import EngineParts   # whose roles hold these

logger = logging.getLogger(__name__)
SUFFIX = ".write-back"   # the id of an answer's written-back KV: the request's id and this
MAX_PULLS = 8            # write-back pulls a prefill worker runs at once
PULL_TIMEOUT_S = 2.0     # a write-back pull not done by then fails (and frees its blocks)
HOLD_S = 0.05            # the longest a waiting prompt waits for the write-back of its prefix


@dataclass(slots=True)
class WriteBackCounts:
    """Running totals of one worker's write-backs (its /metrics)."""

    offered: int = 0         # decode: finished answers whose KV it offered
    cached_blocks: int = 0   # prefill: blocks pulled into its prefix cache
    refused: int = 0         # prefill: offers not taken (no room, too many pulls, malformed)
    failed: int = 0          # prefill: pulls that failed, or whose KV was not of the tokens offered


class WriteBackOffers:
    """Decode: the finished answers whose KV this worker holds for their prefill worker's pull."""

    def __init__(self, parts: EngineParts, kv: KVConnector) -> None:
        self.parts, self.kv = parts, kv
        self._held: dict[str, Sequence] = {}
        self.counts = WriteBackCounts()

    def wants(self, request: Request) -> bool:
        """Whether `request`'s answer, once finished, is to be offered to the prefill worker its KV was just pulled
        from: this worker's write-back mode takes it, and that worker's handshake said it takes write-backs."""
        mode = self.kv.config.write_back
        return (mode == "all" or (mode == "chats" and request.continues_chat)) and \
            request.pull_target is not None and self.kv.takes_write_backs(request.pull_target)

    def offer(self, request: Request) -> None:
        """Holds the full blocks of finished `request`'s prompt and answer that the prefix cache has, and
        offers them to the prefill worker it was pulled from."""
        target, size = request.write_back_target, request.block_size
        manager = self.parts.scheduler.block_manager
        if target is None or request.finish_reason not in ("stop", "length") or request.mm_spans:
            return
        full = (len(request) - 1) // size   # the newest token's KV is never computed
        held_id = request.request_id + SUFFIX
        if full == 0 or held_id in self._held or self.num_held_blocks + full > manager.num_blocks // 4:
            return
        held = Sequence(held_id, request.token_ids[:full * size], max_tokens=1, block_size=size)
        cached = manager.take_cached(held)
        if cached == 0:
            manager.free(held)
            return
        self.hold(held, request.token_ids[:cached * size + 1], target)

    def hold(self, held: Sequence, token_ids: list[int], target: DecodeParams) -> None:
        """Publishes the blocks `held` holds and offers them to `target` as the KV of `token_ids` but the last."""
        try:
            self.kv.publish(held.request_id, list(held.block_table), token_ids[-1])
        except (ConnectorError, ValueError):
            logger.exception("could not hold the KV of %s for its prefill worker", held.request_id)
            self.parts.scheduler.block_manager.free(held)
            return
        self._held[held.request_id] = held
        try:
            self.kv.offer_write_back(held.request_id, target, token_ids)
        except KVTransferError:
            logger.warning("could not offer the KV of %s to its prefill worker", held.request_id, exc_info=True)
            self.kv.discard(held.request_id)   # its release frees the blocks
            return
        self.counts.offered += 1

    def take_released(self, released: list[str]) -> None:
        """Frees the blocks of each offered answer in `released` (pulled, failed or not pulled in time)."""
        for request_id in released:
            if (held := self._held.pop(request_id, None)) is not None:
                self.parts.scheduler.block_manager.free(held)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(s.block_table) for s in self._held.values())

    @property
    def holds_kv(self) -> bool:
        return bool(self._held)


class WriteBackPulls:
    """Prefill: pulls the answers' KV decode workers offer into this worker's prefix cache."""

    def __init__(self, parts: EngineParts, kv: KVConnector) -> None:
        self.parts, self.kv = parts, kv
        self._pulling: dict[str, tuple[Sequence, int]] = {}   # request id -> its blocks, the token after them
        self._holds: dict[str, float] = {}   # waiting request id -> when it stops waiting for a write-back
        self.counts = WriteBackCounts()

    def before_step(self) -> None:
        """Takes new offers, adds each finished pull's blocks to the prefix cache, and holds the waiting prompts
        that extend a pull still running."""
        for offer in self.kv.take_write_backs():
            self._take(offer)
        if self._pulling:
            self._take_finished()
        if self._pulling or self._holds:   # else no waiting prompt is held, nor needs to be
            self._hold_waiting(time.monotonic())

    def wait_hint(self) -> float | None:
        """Seconds until a held prompt stops waiting (None: none is held)."""
        now = time.monotonic()
        return min((until - now for until in self._holds.values() if until > now), default=None)

    def _hold_waiting(self, now: float) -> None:
        holds: dict[str, float] = {}
        for seq in self.parts.scheduler.waiting:
            arriving = not seq.num_computed_tokens and any(
                len(seq) > len(pulled) and seq.token_ids[:len(pulled)] == pulled.token_ids
                for pulled, _ in self._pulling.values())
            if arriving:   # held from the first step that saw it, until then + HOLD_S (and not again)
                holds[seq.request_id] = self._holds.get(seq.request_id, now + HOLD_S)
            seq.kv_arriving = holds.get(seq.request_id, now) > now
        self._holds = holds

    def _take_finished(self) -> None:
        manager = self.parts.scheduler.block_manager
        results = self.kv.take_finished()
        for request_id, token_id in results.done:
            if (pulled := self._pulling.pop(request_id, None)) is None:
                continue
            seq, next_token = pulled
            if token_id == next_token:
                added = len(seq.block_table) - seq.num_hashed_blocks
                manager.commit(seq, len(seq))
                self.counts.cached_blocks += added
            else:
                logger.warning("the KV written back as %s ends before token %d, not %d: not cached", request_id,
                               token_id, next_token)
                self.counts.failed += 1
            manager.free(seq)
        for request_id, error in results.failed:
            if (pulled := self._pulling.pop(request_id, None)) is not None:
                logger.warning("%s", error)
                self.counts.failed += 1
                manager.free(pulled[0])

    def _take(self, offer: WriteBack) -> None:
        manager, size = self.parts.scheduler.block_manager, self.parts.scheduler.block_manager.block_size
        source = DecodeParams(offer.host, offer.port, offer.request_id, offer.engine_id)
        full, rest = divmod(len(offer.token_ids) - 1, size)
        if rest or offer.request_id in self._pulling:
            logger.warning("refused the write-back %s: %d tokens are not whole blocks of %d and one more, or it is "
                           "pulling already", offer.request_id, len(offer.token_ids), size)
            self.counts.refused += 1
            self.kv.release(offer.request_id, source)
            return
        seq = Sequence(offer.request_id, list(offer.token_ids[:-1]), max_tokens=1, block_size=size)
        held = manager.take_cached(seq)
        lacking = full - held
        room = len(self._pulling) < MAX_PULLS and manager.num_free_blocks - lacking >= manager.num_blocks // 2
        if lacking == 0 or not room:
            manager.free(seq)
            self.counts.refused += lacking > 0
            self.kv.release(offer.request_id, source)   # the decode worker frees what it holds now
            return
        manager.may_append(seq)
        try:
            self.kv.start_pull(offer.request_id, source, seq.block_table[held:], held, PULL_TIMEOUT_S)
        except KVTransferError:
            logger.warning("could not pull the write-back %s", offer.request_id, exc_info=True)
            manager.free(seq)
            self.counts.failed += 1
            return
        self._pulling[offer.request_id] = (seq, offer.token_ids[-1])

    @property
    def holds_kv(self) -> bool:
        return bool(self._pulling)
