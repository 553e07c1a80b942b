"""The global prefill queue's contract: the job a requester puts on the NATS JetStream stream, and the
replies the prefill worker that takes it sends back to the requester's reply subject.

    requester (proxy)                    stream STREAM_NAME (work queue)            prefill worker with room
      subscribe(reply); publish PrefillJob  ───────────────────────────────▶  pulls it
      ◀── request: TAKEN (its record, attempt_id) ───────────────────────────  answer GO; no responder: the
                                                                              client left, the job is dropped
      (the decode leg now pulls from that worker)                             runs the prefill leg
      ◀── ANSWER (HTTP status, the leg's answer body) ───────────────────────  KV published (answer_after_pull:
                                                                              in the decode worker's blocks, as
                                                                              it said)
      ◀── ACKED (not answer_after_pull) ─────────────────────────────────────  acks the job once the KV is in
                                                                              the decode worker's blocks
      ◀── REFUSED (why) ── a job that breaks this contract: acked, never retried

Encoded with msgpack, versioned (`JOB_VERSION`). The reply subject also rides in the message header
`REPLY_HEADER`, so that a job whose body cannot be read is still refused back to whoever sent it.
`from_bytes` raises `JobError` naming what is wrong. The keys of the contract are spelled here only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgpack

JOB_VERSION = 1
STREAM_NAME = "NEURON_DI_PREFILL"
JOB_SUBJECT = "neuron_di.prefill.jobs"
CONSUMER_NAME = "prefill-workers"   # the one durable consumer every prefill worker pulls through
REPLY_HEADER = "Neuron-Di-Reply"
REQUESTERS = ("proxy", "decode")
TAKEN, ANSWER, REFUSED, ACKED = "taken", "answer", "refused", "acked"
GO, DROP = b"go", b"drop"           # a requester's answer to TAKEN
DEFAULT_NATS_PORT = 4222


def attempt_id(request_id: str, delivery: int) -> str:
    """The request id a job's `delivery`-th taker runs its prefill leg under (and the decode leg pulls by): the
    job's own the first time, a new one each time it is taken again, so that a decode leg still bound to a
    dead taker never holds the id the next taker's KV is published under."""
    return request_id if delivery <= 1 else f"{request_id}-take{delivery}"


def resent_id(request_id: str, resend: int) -> str:
    """The id of a job put on the queue again, its `resend`-th time, by a requester whose pull failed after the
    job's taker answered (and so acked it): a new job, never taken as a duplicate of the first."""
    return f"{request_id}-again{resend}"


class JobError(ValueError):
    """Bytes that are not a job (or reply) of this contract."""


def nats_url(spec: str) -> str:
    """`nats://HOST:PORT` checked (PORT defaults to 4222); ValueError says what is wrong."""
    parts = urlsplit(spec)
    if parts.scheme != "nats" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"expected nats://HOST:PORT, got {spec!r}")
    try:
        port = parts.port or DEFAULT_NATS_PORT
    except ValueError as exc:
        raise ValueError(f"{spec!r}: {exc}") from exc
    return f"nats://{parts.hostname}:{port}"


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """One prefill leg to run: the OpenAI `path` and `body` the prefill worker would get over HTTP (the prompt or
    its token ids, the sampling parameters, kv_transfer_params naming `request_id`), who asked, where to reply,
    and until when (unix time) the requester waits: a job taken later is dropped. `answer_after_pull`: the
    decode leg is already pulling (concurrent flow), so the worker answers and acks only once the decode worker
    said the KV is in its blocks; a worker that dies before then has its job redelivered and nothing is lost."""

    request_id: str
    path: str
    body: dict[str, Any]
    reply: str
    requester: str = "proxy"
    deadline: float = field(default_factory=lambda: time.time() + 600.0)
    answer_after_pull: bool = False
    version: int = JOB_VERSION

    def __post_init__(self) -> None:
        _check(isinstance(self.request_id, str) and self.request_id, "request_id must be a non-empty string")
        _check(self.path in ("/v1/completions", "/v1/chat/completions"),
               f"path must be /v1/completions or /v1/chat/completions, got {self.path!r}")
        _check(isinstance(self.body, dict), "body must be a map")
        _check(isinstance(self.reply, str) and self.reply, "reply must be a non-empty subject")
        _check(self.requester in REQUESTERS, f"requester must be one of {REQUESTERS}, got {self.requester!r}")
        _check(isinstance(self.deadline, (int, float)) and not isinstance(self.deadline, bool),
               "deadline must be a number")
        _check(isinstance(self.answer_after_pull, bool), "answer_after_pull must be true or false")

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) > self.deadline

    def to_bytes(self) -> bytes:
        return msgpack.packb({"v": self.version, "id": self.request_id, "path": self.path, "body": self.body,
                              "reply": self.reply, "by": self.requester, "deadline": self.deadline,
                              "after_pull": self.answer_after_pull})

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefillJob:
        obj = _unpack(data, "job")
        version = obj.get("v")
        _check(version == JOB_VERSION, f"job version {version!r} is not supported (this worker reads {JOB_VERSION})")
        try:
            return cls(obj["id"], obj["path"], obj["body"], obj["reply"], obj["by"], obj["deadline"],
                       obj.get("after_pull", False), version)
        except KeyError as exc:
            raise JobError(f"job has no {exc.args[0]!r}") from exc


@dataclass(frozen=True, slots=True)
class JobReply:
    """What the prefill worker tells the requester: TAKEN (`worker`: its worker record as a dict, the signal
    plane the decode leg pulls from; `request_id`: the id it runs the job under, see `attempt_id`), ANSWER
    (`status` and `body` of the prefill leg's HTTP answer), REFUSED (`message`: why it cannot be run), or, for a
    job answered before its pull, ACKED (the job is acked: it will not come back, whatever the pull did)."""

    kind: str
    request_id: str = ""
    worker: dict[str, Any] = field(default_factory=dict)
    status: int = 0
    body: bytes = b""
    message: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in (TAKEN, ANSWER, REFUSED, ACKED), f"reply kind {self.kind!r} is unknown")

    def to_bytes(self) -> bytes:
        return msgpack.packb({"kind": self.kind, "id": self.request_id, "worker": self.worker,
                              "status": self.status, "body": self.body, "message": self.message})

    @classmethod
    def from_bytes(cls, data: bytes) -> JobReply:
        obj = _unpack(data, "reply")
        try:
            reply = cls(obj["kind"], obj["id"], obj["worker"], obj["status"], obj["body"], obj["message"])
        except KeyError as exc:
            raise JobError(f"reply has no {exc.args[0]!r}") from exc
        _check(isinstance(reply.worker, dict) and isinstance(reply.status, int) and isinstance(reply.body, bytes)
               and isinstance(reply.message, str), "reply fields have the wrong types")
        return reply


def _unpack(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise JobError(f"{what} is not msgpack: {exc}") from exc
    if not isinstance(obj, dict):
        raise JobError(f"{what} is not a map")
    return obj


def _check(ok: Any, problem: str) -> None:
    if not ok:
        raise JobError(problem)
