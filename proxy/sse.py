"""Server-sent events, sans-I/O: split a byte stream into event payloads, and pass them on.

Events the proxy writes itself are encoded by common.openai_wire.sse_event.
"""
from __future__ import annotations


class SSEDecoder:
    """Feeds on raw bytes in any slicing; returns the `data` payload of each complete event.

    Lines may end in LF, CRLF or CR; multi-line data fields are joined with LF; comments
    and other fields (event, id, retry) are dropped because OpenAI streams carry only data.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            line, sep, rest = self._split_line(self._buffer)
            if not sep:
                return events
            self._buffer = rest
            self._line(line.decode("utf-8"), events)

    def end(self) -> list[str]:
        """The stream is over: a CR held back as a possible CRLF half was a line end after all."""
        if not self._buffer.endswith(b"\r"):
            return []
        return self.feed(b"\n")

    @property
    def pending(self) -> bool:
        """True when a partial event is buffered (the stream was cut mid-event)."""
        return bool(self._buffer.strip() or self._data)

    @staticmethod
    def _split_line(buffer: bytes) -> tuple[bytes, bytes, bytes]:
        cut = min((i for i in (buffer.find(b"\n"), buffer.find(b"\r")) if i >= 0), default=-1)
        if cut < 0:
            return buffer, b"", b""
        if buffer[cut:cut + 1] == b"\r":
            if cut + 1 == len(buffer):
                return buffer, b"", b""  # a CR at the end may be the first half of CRLF
            if buffer[cut + 1:cut + 2] == b"\n":
                return buffer[:cut], b"\r\n", buffer[cut + 2:]
        return buffer[:cut], buffer[cut:cut + 1], buffer[cut + 1:]

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


def encode_raw(data: str) -> bytes:
    """One SSE event carrying a decoded payload as it came: a relayed worker's JSON is not re-serialized."""
    return b"data: " + data.encode() + b"\n\n"
