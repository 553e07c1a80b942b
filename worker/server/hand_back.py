"""Streams a draining worker hands back instead of finishing them (`--drain-hands-back-streams`).

A drain then takes about as long as a stream's next token, not as long as its longest stream: each
running stream ends with an in-band error of type `stream_handed_back` (common/stream_resume.py) after
the tokens it has sent, and the proxy resumes it on another worker from there. Only streams are handed
back: a whole answer has no client-visible tokens yet and finishes here as before.

With a hand-back KV port (`--hand-back-kv-port`) the stream is ended on the engine thread between two
steps: its KV is published for the next decode worker's pull (worker/engine/stream_handoff.py) and the
error names where to pull it from (`kv_transfer_params`), so that worker recomputes nothing.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Iterator, Sequence

from worker.errors import StreamHandedBack

if TYPE_CHECKING:
    from worker.engine.llm_engine import LLMEngine
    from worker.server.async_engine import AsyncEngine, RequestStream

logger = logging.getLogger(__name__)
MESSAGE = "this worker is draining; the stream goes on on another worker"


class HandBack:
    """The running streams of one worker; `hand_back()` ends every one of them for another worker to resume.
    With `engine`, each one's KV waits there for that worker's pull."""

    def __init__(self, engine: AsyncEngine | None = None) -> None:
        self._streams: set[RequestStream] = set()
        self._engine = engine
        self.handed_back = 0

    @contextlib.contextmanager
    def tracking(self, streams: Sequence[RequestStream]) -> Iterator[None]:
        """While a response streams the outputs of `streams`."""
        self._streams.update(streams)
        try:
            yield
        finally:
            self._streams.difference_update(streams)

    def hand_back(self) -> None:
        """Ends each running stream after the outputs it has already: its next read raises StreamHandedBack."""
        if not self._streams:
            return
        streams, self._streams = self._streams, set()
        for stream in streams:
            if self._engine is not None:
                stream.hand_off(self._engine, _with_kv)
            else:
                stream.hand_back(StreamHandedBack(MESSAGE))
        self.handed_back += len(streams)
        logger.info("draining: handed back %d running stream(s) (%d in all)", len(streams), self.handed_back)


def _with_kv(engine: LLMEngine, request_id: str) -> StreamHandedBack:
    """On the engine thread: the end of a handed-back stream, naming where its KV waits when it could be held."""
    hand_offs = getattr(engine.role, "hand_offs", None)   # a decode worker's (worker/engine/stream_handoff.py)
    return StreamHandedBack(MESSAGE, hand_offs.hand_off(request_id) if hand_offs is not None else None)
