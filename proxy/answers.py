"""What the forwarder hands the HTTP layer: a whole JSON body, or the SSE events of a stream."""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncGenerator


@dataclass(frozen=True, slots=True)
class JSONAnswer:
    body: bytes


@dataclass(frozen=True, slots=True)
class StreamAnswer:
    events: AsyncGenerator[bytes, None]


Answer = JSONAnswer | StreamAnswer
