"""Signal-plane messages between a decode DEALER and a prefill ROUTER.

Every message is a frozen dataclass that encodes itself with `to_bytes` and decodes with
`from_bytes`; this module (with the field rules of neuron_connector/wire_fields.py) is the only place
that touches the wire format. Requests carry
`"type"`; replies carry the `"type"` of the request they answer (so a DEALER can match
out-of-order replies), or `"status": "error"` for an `ErrorReply`.

    D -> P                                      P -> D
    Handshake (D's engine id, client nonce)     HandshakeReply (engine id, transfer descriptor,
                                                  server nonce, whether it takes write-backs)
                                                  | ErrorReply (engine_id_in_use)
    KVMapInit (D's layout + descriptor, proof)  KVMapReply (agreed layout, proof) | ErrorReply
    LookupAll (request id, D's block ids,       LookupReply | ErrorReply
      blocks D skips: its cached prefix,
      traceparent of its pull span if traced)
    Release (request id: D's request is gone,   no reply
      or, `pulled`, D holds its KV)
    WriteBack (a finished answer's KV waits     no reply (P pulls it from D's hand-back plane)
      on D's hand-back plane: where, tokens)
                                                Probe (is this session's peer still there?)

With a shared KV secret each side proves it holds it: D's proof and P's proof are HMACs
over both nonces and D's engine id (`DECODE_PROOF`, `PREFILL_PROOF` labels), so neither
can be replayed into another session.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from common.kv_secret import proof as _proof
from neuron_connector.errors import ProtocolError
from neuron_connector.wire_fields import (
    dump_object, generation_field, get_field, load_object, nonempty_field, non_negative_ints, request_id_field,
    with_field, with_proof)

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
        return dump_object(with_field("incarnation", self.incarnation,
                           {"type": self.TYPE, "engine_id": self.engine_id, "nonce": self.nonce}))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Handshake:
        return cls(engine_id=nonempty_field(obj, "engine_id"), nonce=nonempty_field(obj, "nonce"),
                   incarnation=get_field(obj, "incarnation", str, None))


@dataclass(frozen=True, slots=True)
class KVMapInit:
    """D's KV layout (`kv_map`, a KVLayout dict), D's transfer descriptor, and with a
    secret D's proof that it holds it."""

    TYPE: ClassVar[str] = "kv_map_init"
    kv_map: dict[str, Any]
    transfer: dict[str, Any]
    proof: str | None = None

    def to_bytes(self) -> bytes:
        return dump_object(with_proof({"type": self.TYPE, "kv_map": self.kv_map, "transfer": self.transfer},
                                 self.proof))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> KVMapInit:
        return cls(kv_map=get_field(obj, "kv_map", dict), transfer=get_field(obj, "transfer", dict),
                   proof=get_field(obj, "proof", str, None))


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
        obj: dict[str, Any] = with_field("incarnation", self.incarnation, {
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
        return dump_object(obj)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> LookupAll:
        timeout = get_field(obj, "timeout_s", (int, float), None)
        if timeout is not None and not timeout > 0:
            raise ProtocolError(f"field 'timeout_s' must be positive, got {timeout}")
        checksum = get_field(obj, "checksum", str, None)
        if checksum is not None and checksum not in CHECKSUMS:
            raise ProtocolError(f"field 'checksum' must be one of {list(CHECKSUMS)}, got {checksum!r}")
        skipped = get_field(obj, "skipped_blocks", int, None)
        if skipped is not None and skipped < 0:
            raise ProtocolError(f"field 'skipped_blocks' must not be negative, got {skipped}")
        return cls(request_id=request_id_field(obj),
                   block_ids_in_peer_device=non_negative_ints(obj, "block_ids_in_peer_device"),
                   timeout_s=None if timeout is None else float(timeout), checksum=checksum,
                   skipped_blocks=skipped, traceparent=get_field(obj, "traceparent", str, None),
                   generation=generation_field(obj), incarnation=get_field(obj, "incarnation", str, None))


@dataclass(frozen=True, slots=True)
class Release:
    """D is done with a request of P's: it ended before (or while) it pulled, so P may free the blocks now, or
    as soon as it publishes them, instead of holding them until its abort timeout; or, `pulled`, its pull
    ended and the KV is in D's blocks (P frees nothing for it: the push already did). Not answered."""

    TYPE: ClassVar[str] = "release"
    request_id: str
    pulled: bool = False

    def to_bytes(self) -> bytes:
        return dump_object({"type": self.TYPE, "request_id": self.request_id, **({"pulled": True} if self.pulled
                                                                                 else {})})

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Release:
        return cls(request_id=request_id_field(obj), pulled=get_field(obj, "pulled", bool, False))


@dataclass(frozen=True, slots=True)
class WriteBack:
    """D finished a request P prefilled and holds the KV of its prompt and answer for P to pull into its
    prefix cache: `request_id` names it on D's hand-back signal plane at `host`:`port` (engine `engine_id`);
    `token_ids` are the tokens the blocks hold, then the token after them (the pull's output token, a check
    that the KV is of these tokens). Not answered."""

    TYPE: ClassVar[str] = "write_back"
    request_id: str
    host: str
    port: int
    engine_id: str
    token_ids: tuple[int, ...]

    def to_bytes(self) -> bytes:
        return dump_object({"type": self.TYPE, "request_id": self.request_id, "host": self.host, "port": self.port,
                      "engine_id": self.engine_id, "token_ids": list(self.token_ids)})

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> WriteBack:
        port = get_field(obj, "port", int)
        if not 0 < port < 65536:
            raise ProtocolError(f"field 'port' must be a TCP port, got {port}")
        token_ids = non_negative_ints(obj, "token_ids")
        if len(token_ids) < 2:
            raise ProtocolError("field 'token_ids' must name the blocks' tokens and the token after them")
        return cls(request_id=request_id_field(obj), host=nonempty_field(obj, "host"), port=port,
                   engine_id=nonempty_field(obj, "engine_id"), token_ids=token_ids)


@dataclass(frozen=True, slots=True)
class HandshakeReply:
    """P's identity: `timestamp` is when its signal plane started, so a restart shows;
    `nonce` is this session's server nonce; `authenticated`: P requires the KV secret;
    `incarnation`: random, new whenever P's signal plane starts (a restart at the same address
    with the same engine id is another incarnation, which never had the old one's KV);
    `takes_write_backs`: P pulls the answers' KV a decode peer offers (`WriteBack`), so D offers it only then."""

    TYPE: ClassVar[str] = "handshake"
    timestamp: float
    engine_id: str
    transfer: dict[str, Any]
    nonce: str
    authenticated: bool = False
    incarnation: str | None = None
    takes_write_backs: bool = False

    def to_bytes(self) -> bytes:
        return dump_object(with_field("takes_write_backs", self.takes_write_backs or None, with_field(
            "incarnation", self.incarnation, {
                "type": self.TYPE, "status": "ok", "timestamp": self.timestamp, "engine_id": self.engine_id,
                "transfer": self.transfer, "nonce": self.nonce, "authenticated": self.authenticated})))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> HandshakeReply:
        return cls(timestamp=float(get_field(obj, "timestamp", (int, float))),
                   engine_id=get_field(obj, "engine_id", str), transfer=get_field(obj, "transfer", dict),
                   nonce=nonempty_field(obj, "nonce"), authenticated=get_field(obj, "authenticated", bool, False),
                   incarnation=get_field(obj, "incarnation", str, None),
                   takes_write_backs=get_field(obj, "takes_write_backs", bool, False))


@dataclass(frozen=True, slots=True)
class KVMapReply:
    """The layout both sides agreed on (P's own layout, checked against D's), and with a
    secret P's proof that it holds it."""

    TYPE: ClassVar[str] = "kv_map_init"
    kv_map: dict[str, Any]
    proof: str | None = None

    def to_bytes(self) -> bytes:
        return dump_object(with_proof({"type": self.TYPE, "status": "ok", "kv_map": self.kv_map}, self.proof))

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> KVMapReply:
        return cls(kv_map=get_field(obj, "kv_map", dict), proof=get_field(obj, "proof", str, None))


@dataclass(frozen=True, slots=True)
class Probe:
    """P asks whether a session's peer is still connected; the sending alone tells (a gone
    peer's routing id is refused at once), so D ignores it."""

    TYPE: ClassVar[str] = "probe"

    def to_bytes(self) -> bytes:
        return dump_object({"type": self.TYPE, "status": "ok"})

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
        return dump_object(obj)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> LookupReply:
        rid, success = request_id_field(obj), get_field(obj, "success", bool)
        generation = generation_field(obj)
        if not success:
            return cls(request_id=rid, success=False, error=get_field(obj, "error", str, None), generation=generation)
        checksum = get_field(obj, "checksum", int, None)
        if checksum is not None and not 0 <= checksum < 2**32:
            raise ProtocolError(f"field 'checksum' must be a 32-bit unsigned integer, got {checksum}")
        return cls(request_id=rid, success=True, output_token=get_field(obj, "output_token", int, None),
                   block_ids_in_peer_device=non_negative_ints(obj, "block_ids_in_peer_device"), checksum=checksum,
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
        return dump_object(obj)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> ErrorReply:
        return cls(message=get_field(obj, "message", str), code=get_field(obj, "code", str, BAD_REQUEST),
                   reply_to=get_field(obj, "type", str, None), request_id=get_field(obj, "request_id", str, None))


Request = Union[Handshake, KVMapInit, LookupAll, Release, WriteBack]
Reply = Union[HandshakeReply, KVMapReply, LookupReply, Probe, ErrorReply]

_REQUESTS: dict[str, Any] = {c.TYPE: c for c in (Handshake, KVMapInit, LookupAll, Release, WriteBack)}
_REPLIES: dict[str, Any] = {c.TYPE: c for c in (HandshakeReply, KVMapReply, LookupReply, Probe)}


def _decode(data: bytes, table: dict[str, Any], what: str) -> Any:
    obj = load_object(data)
    kind = obj.get("type")
    if kind not in table:
        raise ProtocolError(f"unknown {what} type {kind!r}; expected one of {sorted(table)}")
    return table[kind].from_dict(obj)


def decode_request(data: bytes) -> Request:
    """Decodes a D -> P message; raises ProtocolError for bad JSON or an unknown type."""
    return _decode(data, _REQUESTS, "message")


def decode_reply(data: bytes) -> Reply:
    """Decodes a P -> D message; raises ProtocolError for bad JSON or an unknown type."""
    obj = load_object(data)
    if obj.get("status") == "error":
        return ErrorReply.from_dict(obj)
    return _decode(data, _REPLIES, "reply")


def request_fields(data: bytes) -> tuple[str | None, str | None]:
    """Best-effort (type, request_id) of a message that failed to decode, for the error reply."""
    try:
        obj = load_object(data)
    except ProtocolError:
        return None, None
    kind, rid = obj.get("type"), obj.get("request_id")
    return (kind if isinstance(kind, str) else None), (rid if isinstance(rid, str) else None)
