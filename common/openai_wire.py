"""The OpenAI wire format the proxy and the worker both speak: JSON bodies, error bodies, SSE events, ids."""
from __future__ import annotations

import json
from typing import Any, Mapping

DONE = "[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
COMPLETION_ID_PREFIX = "cmpl-"
CHAT_ID_PREFIX = "chatcmpl-"


def json_bytes(body: Mapping[str, Any]) -> bytes:
    """`body` as compact JSON, the one form used on the wire (an SSE data line must not span lines)."""
    return json.dumps(body, separators=(",", ":")).encode()


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body; `code` repeats the HTTP status."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def sse_event(body: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying `body` as JSON."""
    return b"data: " + json_bytes(body) + b"\n\n"
