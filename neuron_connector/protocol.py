"""Signal-plane messages between a decode DEALER and a prefill ROUTER.

Every message is a frozen dataclass that encodes itself with `to_bytes` and decodes with
`from_bytes`; this module is the only place that touches the wire format. Requests carry
`"type"`; replies carry the `"type"` of the request they answer (so a DEALER can match
out-of-order replies), or `"status": "error"` for an `ErrorReply`.

    D -> P                                      P -> D
    Handshake (D's engine id, client nonce)     HandshakeReply (engine id, transfer descriptor,
                                                  server nonce) | ErrorReply (engine_id_in_use)
    KVMapInit (D's layout + descriptor, proof)  KVMapReply (agreed layout, proof) | ErrorReply
    LookupAll (request id, D's block ids,       LookupReply | ErrorReply
      blocks D skips: its cached prefix,
      traceparent of its pull span if traced)
    Release (request id: D's request is gone)   no reply
                                                Probe (is this session's peer still there?)

With a shared KV secret each side proves it holds it: D's proof and P's proof are HMACs
over both nonces and D's engine id (`DECODE_PROOF`, `PREFILL_PROOF` labels), so neither
can be replayed into another session.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from common.kv_secret import proof as _proof
from neuron_connector.errors import ProtocolError

# ErrorReply codes.
BAD_REQUEST = "bad_request"
HANDSHAKE_REQUIRED = "handshake_required"
LAYOUT_MISMATCH = "layout_mismatch"
UNAUTHORIZED = "unauthorized"
ENGINE_ID_IN_USE = "engine_id_in_use"
STALE_INCARNATION = "stale_incarnation"

# HMAC labels of the two handshake proofs (common.kv_secret.proof).
DECODE_PROOF = b"neuron-di signal plane: decode proof v1"
PREFILL_PROOF = b"neuron-di signal plane: prefill proof v1"


def handshake_proof(secret: bytes, label: bytes, server_nonce: str, client_nonce: str, engine_id: str) -> str:
    """A side's proof of the KV secret for one session (compare with common.kv_secret.verify's
    constant-time check, or `hmac.compare_digest`)."""
    return _proof(secret, label, server_nonce, client_nonce, engine_id)

# Checksums a LookupAll may ask for (transfer.checksum); the reply carries the value.
CRC32C = "crc32c"
CHECKSUMS = (CRC32C,)


def _load(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:   # bad UTF-8, bad JSON, absurd nesting
        raise ProtocolError(f"message is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"message must be a JSON object, got {type(obj).__name__}")
    return obj


def _dump(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _get(obj: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
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


def _block_ids(obj: dict[str, Any], name: str) -> tuple[int, ...]:
    ids = _get(obj, name, list)
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
        raise ProtocolError(f"field {name!r} must be a list of non-negative integers")
    return tuple(ids)


def _request_id(obj: dict[str, Any]) -> str:
    rid = _get(obj, "request_id", str)
    if not rid:
        raise ProtocolError("field 'request_id' must not be empty")
    return rid


def _generation(obj: dict[str, Any]) -> int | None:
    generation = _get(obj, "generation", int, None)
    if generation is not None and not 0 < generation < 2**61:
        raise ProtocolError(f"field 'generation' must be in [1, 2**61), got {generation}")
    return generation


def _nonempty(obj: dict[str, Any], name: str) -> str:
    value = _get(obj, name, str)
    if not value:
        raise ProtocolError(f"field {name!r} must not be empty")
    return value


@dataclass(frozen=True, slots=True)
class Handshake:
    """Opens a session: D's engine id (one live session per id), a fresh client nonce, and D's
    incarnation (random, new whenever its signal plane starts: a restart with the same engine id
    is another incarnation)."""

    TYPE: ClassVar[str] = "handshake"
    engine_id: str
    nonce: str
    incarnation: str | None = None

    def to_bytes(self) -> bytes:
        return _dump(_with("incarnation", self.incarnation,
                           {"type": self.TYPE, "engine_id": self.engine_id, "nonce": self.nonce}))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Handshake:
        return cls(engine_id=_nonempty(obj, "engine_id"), nonce=_nonempty(obj, "nonce"),
                   incarnation=_get(obj, "incarnation", str, None))


@dataclass(frozen=True, slots=True)
class KVMapInit:
    """D's KV layout (`kv_map`, a KVLayout dict), D's transfer descriptor, and with a
    secret D's proof that it holds it."""

    TYPE: ClassVar[str] = "kv_map_init"
    kv_map: dict[str, Any]
    transfer: dict[str, Any]
    proof: str | None = None

    def to_bytes(self) -> bytes:
        return _dump(_with_proof({"type": self.TYPE, "kv_map": self.kv_map, "transfer": self.transfer},
                                 self.proof))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> KVMapInit:
        return cls(kv_map=_get(obj, "kv_map", dict), transfer=_get(obj, "transfer", dict),
                   proof=_get(obj, "proof", str, None))


@dataclass(frozen=True, slots=True)
class LookupAll:
    """`timeout_s`: how long D still waits; P's transfer must not write after that.
    `checksum`: the checksum (one of CHECKSUMS) P computes over the blocks it sends.
    `skipped_blocks`: how many leading blocks of the request D holds already (its prefix
    cache); D's block ids receive the blocks after them, so the two must add up to P's count.
    Without it P sends its last len(block ids) blocks, which is the same for a sender that
    ignores the field. `traceparent`: D's pull span (W3C trace context), the parent of P's push span.
    `generation`: the handoff's generation (transfer.fences): P's push writes only into D's blocks
    while D holds them open for it, and P's reply names it, so D drops a reply of an older handoff.
    `incarnation`: P's incarnation D first asked (HandshakeReply): another refuses it, terminally."""

    TYPE: ClassVar[str] = "lookup_all"
    request_id: str
    block_ids_in_peer_device: tuple[int, ...]
    timeout_s: float | None = None
    checksum: str | None = None
    skipped_blocks: int | None = None
    traceparent: str | None = None
    generation: int | None = None
    incarnation: str | None = None

    def to_bytes(self) -> bytes:
        obj: dict[str, Any] = _with("incarnation", self.incarnation, {
            "type": self.TYPE, "request_id": self.request_id,
            "block_ids_in_peer_device": list(self.block_ids_in_peer_device)})
        if self.generation is not None:
            obj["generation"] = self.generation
        if self.timeout_s is not None:
            obj["timeout_s"] = self.timeout_s
        if self.checksum is not None:
            obj["checksum"] = self.checksum
        if self.skipped_blocks is not None:
            obj["skipped_blocks"] = self.skipped_blocks
        if self.traceparent is not None:
            obj["traceparent"] = self.traceparent
        return _dump(obj)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> LookupAll:
        timeout = _get(obj, "timeout_s", (int, float), None)
        if timeout is not None and not timeout > 0:
            raise ProtocolError(f"field 'timeout_s' must be positive, got {timeout}")
        checksum = _get(obj, "checksum", str, None)
        if checksum is not None and checksum not in CHECKSUMS:
            raise ProtocolError(f"field 'checksum' must be one of {list(CHECKSUMS)}, got {checksum!r}")
        skipped = _get(obj, "skipped_blocks", int, None)
        if skipped is not None and skipped < 0:
            raise ProtocolError(f"field 'skipped_blocks' must not be negative, got {skipped}")
        return cls(request_id=_request_id(obj),
                   block_ids_in_peer_device=_block_ids(obj, "block_ids_in_peer_device"),
                   timeout_s=None if timeout is None else float(timeout), checksum=checksum,
                   skipped_blocks=skipped, traceparent=_get(obj, "traceparent", str, None),
                   generation=_generation(obj), incarnation=_get(obj, "incarnation", str, None))


@dataclass(frozen=True, slots=True)
class Release:
    """D's request ended before (or while) it pulled: P may free the blocks now, or as soon as it
    publishes them, instead of holding them until its abort timeout. Not answered."""

    TYPE: ClassVar[str] = "release"
    request_id: str

    def to_bytes(self) -> bytes:
        return _dump({"type": self.TYPE, "request_id": self.request_id})

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Release:
        return cls(request_id=_request_id(obj))


@dataclass(frozen=True, slots=True)
class HandshakeReply:
    """P's identity: `timestamp` is when its signal plane started, so a restart shows;
    `nonce` is this session's server nonce; `authenticated`: P requires the KV secret;
    `incarnation`: random, new whenever P's signal plane starts (a restart at the same address
    with the same engine id is another incarnation, which never had the old one's KV)."""

    TYPE: ClassVar[str] = "handshake"
    timestamp: float
    engine_id: str
    transfer: dict[str, Any]
    nonce: str
    authenticated: bool = False
    incarnation: str | None = None

    def to_bytes(self) -> bytes:
        return _dump(_with("incarnation", self.incarnation, {
            "type": self.TYPE, "status": "ok", "timestamp": self.timestamp, "engine_id": self.engine_id,
            "transfer": self.transfer, "nonce": self.nonce, "authenticated": self.authenticated}))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> HandshakeReply:
        return cls(timestamp=float(_get(obj, "timestamp", (int, float))),
                   engine_id=_get(obj, "engine_id", str), transfer=_get(obj, "transfer", dict),
                   nonce=_nonempty(obj, "nonce"), authenticated=_get(obj, "authenticated", bool, False),
                   incarnation=_get(obj, "incarnation", str, None))


@dataclass(frozen=True, slots=True)
class KVMapReply:
    """The layout both sides agreed on (P's own layout, checked against D's), and with a
    secret P's proof that it holds it."""

    TYPE: ClassVar[str] = "kv_map_init"
    kv_map: dict[str, Any]
    proof: str | None = None

    def to_bytes(self) -> bytes:
        return _dump(_with_proof({"type": self.TYPE, "status": "ok", "kv_map": self.kv_map}, self.proof))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> KVMapReply:
        return cls(kv_map=_get(obj, "kv_map", dict), proof=_get(obj, "proof", str, None))


@dataclass(frozen=True, slots=True)
class Probe:
    """P asks whether a session's peer is still connected; the sending alone tells (a gone
    peer's routing id is refused at once), so D ignores it."""

    TYPE: ClassVar[str] = "probe"

    def to_bytes(self) -> bytes:
        return _dump({"type": self.TYPE, "status": "ok"})

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Probe:
        return cls()


@dataclass(frozen=True, slots=True)
class LookupReply:
    """`success=False` without `error`: not finished yet, retry. With `error`: terminal.
    `checksum`: on success, the value of the checksum the lookup asked for (a uint32 CRC-32C).
    `generation`: the handoff generation of the lookup it answers, when that named one."""

    TYPE: ClassVar[str] = "lookup_all"
    request_id: str
    success: bool
    output_token: int | None = None
    block_ids_in_peer_device: tuple[int, ...] = field(default=())
    error: str | None = None
    checksum: int | None = None
    generation: int | None = None

    def to_bytes(self) -> bytes:
        obj: dict[str, Any] = {"type": self.TYPE, "request_id": self.request_id, "success": self.success}
        if self.generation is not None:
            obj["generation"] = self.generation
        if self.success:
            if self.output_token is not None:     # None: the prefill worker does not know it (vLLM's)
                obj["output_token"] = self.output_token
            obj["block_ids_in_peer_device"] = list(self.block_ids_in_peer_device)
            if self.checksum is not None:
                obj["checksum"] = self.checksum
        if self.error is not None:
            obj["error"] = self.error
        return _dump(obj)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> LookupReply:
        rid, success = _request_id(obj), _get(obj, "success", bool)
        generation = _generation(obj)
        if not success:
            return cls(request_id=rid, success=False, error=_get(obj, "error", str, None), generation=generation)
        checksum = _get(obj, "checksum", int, None)
        if checksum is not None and not 0 <= checksum < 2**32:
            raise ProtocolError(f"field 'checksum' must be a 32-bit unsigned integer, got {checksum}")
        return cls(request_id=rid, success=True, output_token=_get(obj, "output_token", int, None),
                   block_ids_in_peer_device=_block_ids(obj, "block_ids_in_peer_device"), checksum=checksum,
                   generation=generation)


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A refused message; `reply_to` and `request_id` are set when they could be read."""

    message: str
    code: str = BAD_REQUEST
    reply_to: str | None = None
    request_id: str | None = None

    def to_bytes(self) -> bytes:
        obj: dict[str, Any] = {"status": "error", "message": self.message, "code": self.code}
        if self.reply_to is not None:
            obj["type"] = self.reply_to
        if self.request_id is not None:
            obj["request_id"] = self.request_id
        return _dump(obj)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> ErrorReply:
        return cls(message=_get(obj, "message", str), code=_get(obj, "code", str, BAD_REQUEST),
                   reply_to=_get(obj, "type", str, None), request_id=_get(obj, "request_id", str, None))


Request = Union[Handshake, KVMapInit, LookupAll, Release]
Reply = Union[HandshakeReply, KVMapReply, LookupReply, Probe, ErrorReply]

_REQUESTS: dict[str, Any] = {c.TYPE: c for c in (Handshake, KVMapInit, LookupAll, Release)}
_REPLIES: dict[str, Any] = {c.TYPE: c for c in (HandshakeReply, KVMapReply, LookupReply, Probe)}


def _with(name: str, value: Any, obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` with the optional field `name`, when it has a value."""
    return obj if value is None else {**obj, name: value}


def _with_proof(obj: dict[str, Any], proof: str | None) -> dict[str, Any]:
    return obj if proof is None else {**obj, "proof": proof}


def _decode(data: bytes, table: dict[str, Any], what: str) -> Any:
    obj = _load(data)
    kind = obj.get("type")
    if kind not in table:
        raise ProtocolError(f"unknown {what} type {kind!r}; expected one of {sorted(table)}")
    return table[kind].from_dict(obj)


def decode_request(data: bytes) -> Request:
    """Decodes a D -> P message; raises ProtocolError for bad JSON or an unknown type."""
    return _decode(data, _REQUESTS, "message")


def decode_reply(data: bytes) -> Reply:
    """Decodes a P -> D message; raises ProtocolError for bad JSON or an unknown type."""
    obj = _load(data)
    if obj.get("status") == "error":
        return ErrorReply.from_dict(obj)
    return _decode(data, _REPLIES, "reply")


def request_fields(data: bytes) -> tuple[str | None, str | None]:
    """Best-effort (type, request_id) of a message that failed to decode, for the error reply."""
    try:
        obj = _load(data)
    except ProtocolError:
        return None, None
    kind, rid = obj.get("type"), obj.get("request_id")
    return (kind if isinstance(kind, str) else None), (rid if isinstance(rid, str) else None)
