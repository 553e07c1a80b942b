"""Sans-I/O framing of the tcp transport: pure encode/decode of headers, tested with bytes.

Each transfer on a connection is one write request header, its block ranges (and for a
fenced write the handoff's generation: transfer.fences), and the payload; the server answers
with one reply header and its message. Payload bytes are the runs' chunk ranges in
`byte_ranges` order, so neither side ever serializes blocks: they are sent from and received
into pool memory directly.

A connection opens with the server's challenge (random bytes); the writer's hello then
carries, when a KV secret is set, HMAC(secret, `HELLO_PROOF` | challenge | transfer id).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from transfer.errors import (InvalidBlocks, LayoutMismatch, PeerLost, RegionNotRegistered, StaleHandoff,
                             TransferError, Unauthorized)

MAGIC = b"NDKV"
OP_HELLO, OP_WRITE, OP_FENCED_WRITE = 1, 2, 3
_GENERATION = struct.Struct("!Q")
GENERATION_BYTES = _GENERATION.size
_REQUEST = struct.Struct("!4sBQIQ")   # magic, op, transfer id, number of ranges, payload bytes
# magic, op, transfer id, status, payload bytes, message bytes. Replies carry no payload (the
# field is always 0); it stays so the frame is the one peers of earlier versions read.
_REPLY = struct.Struct("!4sBQBQI")
REQUEST_BYTES, REPLY_BYTES = _REQUEST.size, _REPLY.size
MAX_HELLO_BYTES = 1 << 16
_CHALLENGE = struct.Struct("!4s32s")  # magic, random bytes
CHALLENGE_BYTES = _CHALLENGE.size
HELLO_PROOF = b"neuron-di tcp transfer: writer proof v1"

# Status codes map one-to-one onto the error tree, so the sender re-raises the same type.
_STATUS: dict[int, type[TransferError]] = {
    1: InvalidBlocks, 2: RegionNotRegistered, 3: LayoutMismatch, 4: PeerLost, 5: TransferError,
    6: Unauthorized, 7: StaleHandoff}
_CODES = {cls: code for code, cls in _STATUS.items()}


@dataclass(frozen=True, slots=True)
class Request:
    op: int
    transfer_id: int
    ranges: list[tuple[int, int]]    # (first block, count) on the server's side
    payload_bytes: int
    generation: int | None = None    # OP_FENCED_WRITE: the handoff the blocks must be open for


@dataclass(frozen=True, slots=True)
class Reply:
    op: int
    transfer_id: int
    status: int
    message: str

    def raise_for_status(self) -> None:
        if self.status:
            raise _STATUS.get(self.status, TransferError)(f"peer: {self.message}")


def encode_request(req: Request) -> bytes:
    flat = [v for r in req.ranges for v in r]
    head = _REQUEST.pack(MAGIC, req.op, req.transfer_id, len(req.ranges), req.payload_bytes)
    tail = b"" if req.op != OP_FENCED_WRITE else _GENERATION.pack(req.generation or 0)
    return head + struct.pack(f"!{len(flat)}Q", *flat) + tail


def decode_request_head(data: bytes) -> tuple[int, int, int, int]:
    """(op, transfer id, number of ranges, payload bytes); the ranges follow."""
    magic, op, tid, count, payload = _REQUEST.unpack(data)
    if magic != MAGIC or op not in (OP_HELLO, OP_WRITE, OP_FENCED_WRITE):
        raise PeerLost(f"bad request header {data[:8]!r}: not a KV transfer stream")
    if op == OP_HELLO and payload > MAX_HELLO_BYTES:
        raise PeerLost(f"hello of {payload} bytes is too large")
    return op, tid, count, payload


def decode_ranges(data: bytes) -> list[tuple[int, int]]:
    """The (first block, count) pairs that follow a request header: 16 bytes each."""
    flat = struct.unpack(f"!{len(data) // 8}Q", data)
    return list(zip(flat[0::2], flat[1::2]))


def decode_generation(data: bytes) -> int:
    """The generation that follows a fenced write's ranges."""
    return _GENERATION.unpack(data)[0]


def encode_reply(op: int, transfer_id: int, error: TransferError | None = None) -> bytes:
    status = 0 if error is None else _CODES.get(type(error), 5)
    message = b"" if error is None else str(error).encode()
    return _REPLY.pack(MAGIC, op, transfer_id, status, 0, len(message)) + message


def decode_reply_head(data: bytes) -> tuple[Reply, int]:
    """The reply without its message, and how many message bytes follow."""
    magic, op, tid, status, _, msg_len = _REPLY.unpack(data)
    if magic != MAGIC:
        raise PeerLost(f"bad reply header {data[:8]!r}: not a KV transfer stream")
    return Reply(op, tid, status, ""), msg_len


def encode_challenge(challenge: bytes) -> bytes:
    return _CHALLENGE.pack(MAGIC, challenge)


def decode_challenge(data: bytes) -> bytes:
    magic, challenge = _CHALLENGE.unpack(data)
    if magic != MAGIC:
        raise PeerLost(f"bad challenge {data[:8]!r}: not a KV transfer stream")
    return challenge


def encode_hello(fields: dict[str, Any]) -> bytes:
    body = json.dumps(fields).encode()
    return _REQUEST.pack(MAGIC, OP_HELLO, 0, 0, len(body)) + body


def decode_hello(body: bytes) -> dict[str, Any]:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise PeerLost(f"malformed hello: {exc}") from exc
