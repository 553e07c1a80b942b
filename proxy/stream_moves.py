"""Streams that survive their decode worker (`--resume-streams`).

A streamed disaggregated answer asks its legs for the ids of the tokens they make (the key in
common/stream_resume.py; the client sees them only if it asked). When its decode leg is lost mid-answer
(the worker died: connection cut, or it left the pool) or handed back (a draining worker ended the
stream), the answer moves: the request goes, whole, to another decode worker with the tokens the client
has so far; that worker computes their KV with the prompt's, takes them as its own outputs and streams on
from the next token. A draining worker may name where it holds the stream's KV (`kv_transfer_params` in its
hand-back error): the new worker then gets a decode leg that pulls that KV over the transfer engine instead
of recomputing it, and should that pull fail the answer moves once more, recomputed. The client sees one
stream: no token twice, none missing; greedy and seeded answers come out as one worker's would. Only our
workers resume (a vLLM server does not know the keys).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from common.handoff import KV_TRANSFER_PARAMS, DecodeParams, HandoffError, PrefillHandoff
from common.stream_resume import HANDED_BACK, RESUME_FROM, RESUME_TEXT, TOKEN_IDS, wants_token_ids
from common.worker_record import VLLM_SERVER
from proxy.errors import ProxyError, UpstreamUnavailable, WorkerLost
from proxy.flows import DecodeLeg
from proxy.requests import ClientRequest
from proxy.stitch import StreamStitcher
from proxy.workers import WorkerRecord

log = logging.getLogger("proxy.stream_moves")
MAX_MOVES = 4  # per answer: a stream that keeps losing its worker ends with the error at last
REASONS = ("worker_lost", "handed_back", "kv_pull_failed")
KV_PATHS = ("pulled", "recomputed")   # how the new worker got the stream's KV: over the transfer engine, or not
_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_NOT_RESUMED = ("echo", "prompt_logprobs")  # shown once, at the start, by the first leg
OpenLeg = Callable[[WorkerRecord, dict[str, Any], dict[str, str]], DecodeLeg]


class MoveMetrics:
    """Moved streams by reason, and the gap each move left in its stream."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.moves = Counter("proxy_stream_moves", "Streamed answers moved to another decode worker mid-answer, by "
                             "reason: worker_lost (it died or left), handed_back (it drained) or kv_pull_failed (the "
                             "new worker could not pull the KV the drained one held), and by how the new worker "
                             "got the KV: kv=pulled (over the transfer engine) or kv=recomputed", ["reason", "kv"],
                             registry=registry)
        self.gaps = Histogram("proxy_stream_move_gap_seconds", "Time between the last event of a stream's lost "
                              "leg and the first of the leg it moved to", buckets=_GAP_BUCKETS, registry=registry)
        for reason in REASONS:
            for kv in KV_PATHS:
                self.moves.labels(reason, kv)


def resumable(request: ClientRequest, decode: WorkerRecord) -> bool:
    """Whether a stream on `decode` can move: streamed, one answer, and our worker (vLLM ignores the keys)."""
    return request.stream and decode.server != VLLM_SERVER


def with_token_ids(request: ClientRequest) -> ClientRequest:
    """`request` with its legs asking for the token ids of their answers."""
    return replace(request, body={**request.body, TOKEN_IDS: True})


class StreamMover:
    """One streamed answer's tokens so far, and its move to another decode worker when its leg is lost.

    `open_leg(worker, body, headers)` starts a streamed leg; `pick(kv_protocol)` names a decode worker;
    `gone(worker, why)` takes a worker that handed a stream back out of rotation."""

    def __init__(self, request: ClientRequest, uid: str, seed: int | None, open_leg: OpenLeg,
                 pick: Callable[[str], WorkerRecord], gone: Callable[[WorkerRecord, str], None],
                 metrics: MoveMetrics) -> None:
        self._request, self._uid, self._seed = request, uid, seed
        self._open_leg, self._pick, self._gone, self._metrics = open_leg, pick, gone, metrics
        self._show_ids = wants_token_ids(request.body)
        self._ids: list[int] = []         # the answer's tokens so far (prefill's first)
        self._decode_seen = False         # the first decode leg repeats prefill's token: its ids replace it
        self._moved_from: float | None = None   # when the lost leg's last event came, until the next one comes
        self._kv_from: PrefillHandoff | None = None   # where the worker that handed the stream back holds its KV
        self._pulling = False             # the current leg pulls that KV and has sent nothing yet
        self._last = time.perf_counter()
        self.moves = 0
        self.largest_gap = 0.0

    def prefill_answer(self, first: dict[str, Any]) -> dict[str, Any]:
        """Prefill's answer: its token's id noted (and hidden unless the client asked for ids)."""
        choice = (first.get("choices") or [{}])[0]
        if isinstance(choice, dict) and isinstance(choice.get("token_ids"), list):
            self._ids = list(choice["token_ids"])
            if not self._show_ids:
                first = {**first, "choices": [{**choice, "token_ids": None}, *first["choices"][1:]]}
        return first

    def why_lost(self, item: Any) -> str | None:
        """The reason the item a leg delivered means the leg is lost and the answer should move; None if not."""
        if isinstance(item, (UpstreamUnavailable, WorkerLost)):
            return "worker_lost"
        if self._pulling and isinstance(item, ProxyError):
            return "kv_pull_failed"
        if isinstance(item, str) and HANDED_BACK in item:
            try:
                error = json.loads(item).get("error")
            except (ValueError, AttributeError):
                return None
            if isinstance(error, dict) and error.get("type") == HANDED_BACK:
                self._kv_from = _kv_source(error)
                return "handed_back"
        return None

    def observe(self, data: str) -> str | None:
        """One SSE payload of the current leg: its token ids noted (and hidden unless asked for); None for one
        the client must not see (a moved stream's own role chunk)."""
        now = time.perf_counter()
        if self._moved_from is not None:
            gap, self._moved_from = now - self._moved_from, None
            self._metrics.gaps.observe(gap)
            self.largest_gap = max(self.largest_gap, gap)
        self._last, self._pulling = now, False
        try:
            chunk = json.loads(data)
        except ValueError:
            return data  # the stitcher says what is wrong with it
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            return data
        choices = []
        for choice in chunk["choices"]:
            if not isinstance(choice, dict):
                return data
            if self.moves and "role" in (choice.get("delta") or {}) and not choice.get("token_ids"):
                continue  # the chat role chunk of a moved stream: the client had it from the first leg
            if isinstance(choice.get("token_ids"), list):
                if not self._decode_seen:
                    self._decode_seen, self._ids = True, []
                self._ids.extend(choice["token_ids"])
                if not self._show_ids:
                    choice = {**choice, "token_ids": None}
            choices.append(choice)
        if chunk["choices"] and not choices:
            return None
        return json.dumps({**chunk, "choices": choices})

    def move(self, leg: DecodeLeg, why: str, stitcher: StreamStitcher, error: BaseException | None) -> DecodeLeg:
        """The leg the answer goes on with on another decode worker, after `leg` was lost (`why`); raises `error`
        (or an UpstreamUnavailable) when the answer has moved too often already."""
        if self.moves >= MAX_MOVES:
            raise error or UpstreamUnavailable(f"stream handed back {self.moves + 1} times", "decode",
                                               leg.worker.address)
        leg.task.cancel()
        if why == "handed_back":
            self._gone(leg.worker, "it drains")
        self.moves += 1
        self._decode_seen = True  # a moved stream does not repeat a token
        worker = self._pick(leg.worker.kv_protocol)
        kv_from, self._kv_from = (self._kv_from if why == "handed_back" else None), None
        self._pulling = kv_from is not None
        log.info("answer %s: decode worker %s %s after %d tokens; resuming it on %s (%s)", self._uid,
                 leg.worker.address, why.replace("_", " "), len(self._ids), worker.address,
                 "pulling its KV" if kv_from else "recomputing its KV")
        self._metrics.moves.labels(why, "pulled" if kv_from else "recomputed").inc()
        self._moved_from = self._last
        text_chars = stitcher.resumed()
        pull = None if kv_from is None else DecodeParams(kv_from.host, kv_from.port, kv_from.request_id,
                                                         kv_from.engine_id)
        uid = pull.request_id if pull is not None else f"{self._uid}-moved{self.moves}"
        return self._open_leg(worker, self._resumed_body(text_chars, pull), {"X-Request-Id": uid})

    def _resumed_body(self, text_chars: int, pull: DecodeParams | None) -> dict[str, Any]:
        body = {k: v for k, v in self._request.body.items() if k not in _NOT_RESUMED}
        body.update({RESUME_FROM: list(self._ids), RESUME_TEXT: text_chars, TOKEN_IDS: True})
        if pull is not None:
            body[KV_TRANSFER_PARAMS] = pull.to_dict()
        if self._seed is not None:
            body["seed"] = self._seed
        return body


def _kv_source(error: dict[str, Any]) -> PrefillHandoff | None:
    """Where a hand-back error says the stream's KV waits; None when it names no complete place."""
    try:
        source = PrefillHandoff.parse(error.get(KV_TRANSFER_PARAMS) or {})
    except HandoffError:
        log.warning("a hand-back error names no usable kv_transfer_params: %r", error.get(KV_TRANSFER_PARAMS))
        return None
    return source if source.host and source.port and source.request_id else None
