"""The JSON field rules of every signal-plane message (neuron_connector/protocol.py): how a message object is
read and written, and how each kind of field is checked (a bad one raises ProtocolError)."""
from __future__ import annotations

import json
from typing import Any

from neuron_connector.errors import ProtocolError


def load_object(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:   # bad UTF-8, bad JSON, absurd nesting
        raise ProtocolError(f"message is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"message must be a JSON object, got {type(obj).__name__}")
    return obj


def dump_object(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def get_field(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in obj:
        if default is ...:
            raise ProtocolError(f"message {obj.get('type')!r} lacks field {name!r}")
        return default
    value = obj[name]
    # bool is an int subclass; a block id or token of `true` is a bug, not a number.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ProtocolError(f"field {name!r} must be {kind}, got a bool")
    if not isinstance(value, kind):
        raise ProtocolError(f"field {name!r} must be {kind}, got {type(value).__name__}")
    return value


def non_negative_ints(obj: dict[str, Any], name: str) -> tuple[int, ...]:
    ids = get_field(obj, name, list)
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
        raise ProtocolError(f"field {name!r} must be a list of non-negative integers")
    return tuple(ids)


def request_id_field(obj: dict[str, Any]) -> str:
    rid = get_field(obj, "request_id", str)
    if not rid:
        raise ProtocolError("field 'request_id' must not be empty")
    return rid


def generation_field(obj: dict[str, Any]) -> int | None:
    generation = get_field(obj, "generation", int, None)
    if generation is not None and not 0 < generation < 2**61:
        raise ProtocolError(f"field 'generation' must be in [1, 2**61), got {generation}")
    return generation


def nonempty_field(obj: dict[str, Any], name: str) -> str:
    value = get_field(obj, name, str)
    if not value:
        raise ProtocolError(f"field {name!r} must not be empty")
    return value


def with_field(name: str, value: Any, obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with the optional field `name`, when it has a value."""
    return obj if value is None else {**obj, name: value}


def with_proof(obj: dict[str, Any], proof: str | None) -> dict[str, Any]:
    return obj if proof is None else {**obj, "proof": proof}
