"""What the forwarder hands the HTTP layer, a whole JSON body or the SSE events of a stream, and how a
disaggregated request's prefill answer and decode leg become the answer one server would give."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable

from common.openai_wire import json_bytes
from common.timeline import Timeline
from proxy.errors import ProxyError
from proxy.flows import DecodeLeg, first_or_failure, json_object
from proxy.metrics import Metrics
from proxy.requests import ClientRequest
from proxy.stitch import StreamStitcher, first_token_repeated, merge_bodies, prefill_answer, prefill_finished
from proxy.stream_moves import StreamMover
from proxy.streams import cancel_leg, relayed, stitched
from proxy.timing import AnswerTimer
from proxy.workers import WorkerRecord

log = logging.getLogger("proxy.answers")


@dataclass(frozen=True, slots=True)
class JSONAnswer:
    body: bytes


@dataclass(frozen=True, slots=True)
class StreamAnswer:
    events: AsyncGenerator[bytes, None]


Answer = JSONAnswer | StreamAnswer


class AnswerAssembler:
    """Prefill's answer and a decode leg -> one answer; each checked first token counted in `metrics`, each
    answer's end marked in `timeline`."""

    def __init__(self, metrics: Metrics, timeline: Timeline) -> None:
        self._metrics = metrics
        self._timeline = timeline

    async def answer(self, request: ClientRequest, uid: str, first: dict[str, Any], leg: DecodeLeg | None,
                     started: float, abandon: Callable[[], None], token_used: bool = True,
                     mover: StreamMover | None = None) -> Answer:
        """Prefill's answer and the decode leg (None: not called) -> the answer one server would give; a stream
        that fails after it began calls `abandon` (prefill's KV may still be held, see proxy/abandon.py);
        without `token_used`, the first token is decode's (prefill's was not sampled as the answer's)."""
        response_id = request.endpoint.id_prefix + uid
        try:
            if not request.stream:
                answer = JSONAnswer(json_bytes(await self._whole(response_id, first, leg, token_used)))
                self._timeline.finish(uid)
                return answer
            first = first if mover is None else mover.prefill_answer(first)
            stitcher = StreamStitcher(request, response_id, int(time.time()), first, token_used)
            events = stitcher.first()
        except BaseException:
            cancel_leg(leg)
            raise
        if stitcher.finished:
            cancel_leg(leg)  # EOS at token one: decode has nothing to add
        timer = AnswerTimer(self._metrics, started, self._timeline, uid)
        return StreamAnswer(stitched(stitcher, events, leg, timer, self._first_token, abandon, mover))

    async def _whole(self, response_id: str, first: dict[str, Any], leg: DecodeLeg | None,
                     token_used: bool) -> dict[str, Any]:
        if leg is None or (token_used and prefill_finished(first)):
            cancel_leg(leg)  # EOS at token one: decode has nothing to add
            return prefill_answer(response_id, first)
        rest = json_object(await leg.task, leg.worker)
        if token_used and (matched := first_token_repeated(first, rest)) is not None:
            self._first_token(leg.worker, matched)
        return merge_bodies(response_id, first, rest, token_used)

    async def relay(self, request: ClientRequest, uid: str | None, leg: DecodeLeg, started: float) -> Answer:
        """One leg's answer as it comes (a single leg, or decode_first's decode leg), ending the timeline of the
        request id `uid` if given; a stream waits for its first event, so that an early failure still gets an
        HTTP status."""
        if leg.queue is None:
            answer = JSONAnswer(await leg.task)
            if uid is not None:
                self._timeline.finish(uid)
            return answer
        first = await first_or_failure(asyncio.ensure_future(leg.queue.get()), leg.task)
        if isinstance(first, ProxyError):
            raise first
        return StreamAnswer(relayed(first, leg.queue, leg.task, AnswerTimer(self._metrics, started, self._timeline,
                                                                              uid)))

    def _first_token(self, decode: WorkerRecord, matched: bool) -> None:
        """Counts one checked first token; a different one means the KV did not arrive intact."""
        self._metrics.first_token(decode.kv_protocol, matched)
        if not matched:
            log.warning("decode worker %s: first token differs from prefill's (KV not intact?)", decode.address)
