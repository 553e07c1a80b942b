"""Streams a draining worker hands back instead of finishing them (`--drain-hands-back-streams`).

A drain then takes about as long as a stream's next token, not as long as its longest stream: each
running stream ends with an in-band error of type `stream_handed_back` (common/stream_resume.py) after
the tokens it has sent, and the proxy resumes it on another worker from there. Only streams are handed
back: a whole answer has no client-visible tokens yet and finishes here as before.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Iterator, Sequence

from worker.errors import StreamHandedBack

if TYPE_CHECKING:
    from worker.server.async_engine import RequestStream

logger = logging.getLogger(__name__)


class HandBack:
    """The running streams of one worker; `hand_back()` ends every one of them for another worker to resume."""

    def __init__(self) -> None:
        self._streams: set[RequestStream] = set()
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
            stream.hand_back(StreamHandedBack("this worker is draining; the stream goes on on another worker"))
        self.handed_back += len(streams)
        logger.info("draining: handed back %d running stream(s) (%d in all)", len(streams), self.handed_back)
