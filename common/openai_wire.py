"""The OpenAI wire format the proxy and the worker both speak: JSON bodies, error bodies, SSE events, ids."""
from __future__ import annotations

import json
from typing import Any, Mapping

DONE = "[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
COMPLETION_ID_PREFIX = "cmpl-"
CHAT_ID_PREFIX = "chatcmpl-"
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # `seed` is an int64, as vLLM accepts it
# How deep a request body may nest. OpenAI bodies need a handful of levels (a tool's JSON schema
# a few dozen); the bound keeps both parsing and re-encoding far from Python's recursion limit.
MAX_JSON_DEPTH = 64
# The error type of a worker's 503 to a request that came while it drains: nothing of it started, so
# the proxy may send it to another worker.
WORKER_DRAINING = "worker_draining"


def load_object(raw: bytes) -> dict[str, Any]:
    """A request body, which must be one JSON object nested at most MAX_JSON_DEPTH deep; ValueError says why not."""
    too_deep = f"request body is nested more than {MAX_JSON_DEPTH} levels deep"
    try:
        body = json.loads(raw)
    except RecursionError:  # the decoder's own bound, far deeper than ours
        raise ValueError(too_deep) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    # A body with fewer brackets than the bound cannot nest deeper: the usual body is never walked.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(body, MAX_JSON_DEPTH):
        raise ValueError(too_deep)
    return body


def _deeper_than(body: dict[str, Any], limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def json_bytes(body: Mapping[str, Any]) -> bytes:
    """`body` as compact JSON, the one form used on the wire (an SSE data line must not span lines)."""
    return json.dumps(body, separators=(",", ":")).encode()


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body; `code` repeats the HTTP status."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def sse_event(body: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying `body` as JSON."""
    return b"data: " + json_bytes(body) + b"\n\n"
