"""The disaggregated handoff: what travels in a request's or an answer's `kv_transfer_params`.

A prefill leg carries `PrefillParams` (which request the KV it keeps belongs to); its answer carries a
`PrefillHandoff` (where its signal plane serves that KV); the decode leg carries `DecodeParams` (where to
pull the KV from, and for decode_first the prefill worker's HTTP API), or `QueuedDecodeParams`
(decode_first through the global prefill queue: the decode worker puts the prefill leg on the queue). The dicts keep vLLM's connector
conventions (`remote_host`, `remote_port`, `remote_engine_id`), so vLLM workers and the proxy exchange
them as they are. `parse` of each raises `HandoffError` (a ValueError) naming the bad key.

The keys of the contract are spelled in this module only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

KV_TRANSFER_PARAMS = "kv_transfer_params"   # the request and answer field that carries the handoff
PREFILL, DECODE = "prefill", "decode"

_ROLE, _REQUEST_ID, _PULLED_ON_STOP, _DECODE_ENGINE = "role", "request_id", "pulled_on_stop", "decode_engine_id"
_HOST, _PORT, _ENGINE_ID, _URL = "remote_host", "remote_port", "remote_engine_id", "remote_url"
_QUEUE = "prefill_queue"


class HandoffError(ValueError):
    """A `kv_transfer_params` value that breaks the contract; `key` names the bad key (None: the whole value)."""

    def __init__(self, key: str | None, problem: str) -> None:
        super().__init__(f"{KV_TRANSFER_PARAMS}.{key} {problem}" if key else f"{KV_TRANSFER_PARAMS} {problem}")
        self.key = key


def _mapping(obj: Any) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise HandoffError(None, f"must be an object, got {obj!r}")
    return obj


def _opt_str(obj: Mapping[str, Any], key: str) -> str | None:
    """A key that is absent, null or a non-empty string."""
    value = obj.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise HandoffError(key, "must be a non-empty string")
    return value


def _opt_port(obj: Mapping[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536):
        raise HandoffError(key, f"must be a TCP port, got {value!r}")
    return value


def _opt_request_id(obj: Mapping[str, Any]) -> str | None:
    value = obj.get(_REQUEST_ID)
    if value is not None and not isinstance(value, str):
        raise HandoffError(_REQUEST_ID, f"must be a string, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class PrefillParams:
    """A prefill leg: keep the prompt's KV for request `request_id`'s decode leg. `pulled_on_stop` False:
    when the one token ends the answer, no decode leg follows, so the KV is freed at once.
    `decode_engine_id`: the decode engine that will pull it (its KV is freed soon after that engine's
    signal-plane session is lost)."""

    request_id: str | None = None
    pulled_on_stop: bool = True
    decode_engine_id: str | None = None

    role = PREFILL

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {_ROLE: PREFILL}
        if self.request_id is not None:
            out[_REQUEST_ID] = self.request_id
        if not self.pulled_on_stop:
            out[_PULLED_ON_STOP] = False
        if self.decode_engine_id is not None:
            out[_DECODE_ENGINE] = self.decode_engine_id
        return out

    @classmethod
    def parse(cls, obj: Any) -> PrefillParams:
        obj = _expect_role(obj, PREFILL)
        pulled = obj.get(_PULLED_ON_STOP, True)
        if not isinstance(pulled, bool):
            raise HandoffError(_PULLED_ON_STOP, f"must be true or false, got {pulled!r}")
        return cls(_opt_request_id(obj), pulled, _opt_str(obj, _DECODE_ENGINE))


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """A decode leg: pull request `request_id`'s prompt KV from the signal plane at `host`:`port` (whose
    handshake must show `engine_id`, when given); `remote_url` (decode_first): the prefill worker's HTTP
    API, which the decode worker sends the prefill leg itself."""

    host: str
    port: int
    request_id: str | None = None
    engine_id: str | None = None
    remote_url: str | None = None

    role = DECODE

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {_ROLE: DECODE}
        if self.request_id is not None:
            out[_REQUEST_ID] = self.request_id
        out.update({_HOST: self.host, _PORT: self.port})
        if self.engine_id is not None:
            out[_ENGINE_ID] = self.engine_id
        if self.remote_url is not None:
            out[_URL] = self.remote_url
        return out

    @classmethod
    def parse(cls, obj: Any) -> DecodeParams:
        obj = _expect_role(obj, DECODE)
        host, port = obj.get(_HOST), obj.get(_PORT)
        if not isinstance(host, str) or not host:
            raise HandoffError(_HOST, "must be a non-empty string")
        if _opt_port(obj, _PORT) is None:
            raise HandoffError(_PORT, f"must be a TCP port, got {port!r}")
        url = obj.get(_URL)
        if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
            raise HandoffError(_URL, f"must be an http(s) URL, got {url!r}")
        return cls(host, port, _opt_request_id(obj), _opt_str(obj, _ENGINE_ID), url.rstrip("/") if url else None)


@dataclass(frozen=True, slots=True)
class QueuedDecodeParams:
    """A decode leg of decode_first through the global prefill queue: the decode worker puts request
    `request_id`'s prefill leg on the queue, and pulls the KV from whichever prefill worker takes it."""

    request_id: str

    role = DECODE

    def to_dict(self) -> dict[str, Any]:
        return {_ROLE: DECODE, _REQUEST_ID: self.request_id, _QUEUE: True}

    def pull_from(self, host: str, port: int, request_id: str, engine_id: str | None) -> DecodeParams:
        """The decode leg once a prefill worker took the job: its signal plane, the id it runs the job under."""
        return DecodeParams(host, port, request_id, engine_id)


def queued_leg(obj: Any) -> QueuedDecodeParams | None:
    """A request's `kv_transfer_params` as a queued decode leg; None when they are not one."""
    if not isinstance(obj, Mapping) or obj.get(_ROLE) != DECODE or _QUEUE not in obj:
        return None
    if obj[_QUEUE] is not True:
        raise HandoffError(_QUEUE, f"must be true, got {obj[_QUEUE]!r}")
    request_id = _opt_request_id(obj)
    if not request_id:
        raise HandoffError(_REQUEST_ID, "must name the request (a queued decode leg)")
    return QueuedDecodeParams(request_id)


@dataclass(frozen=True, slots=True)
class ForeignParams:
    """Params without a role: another connector's (such as vLLM's NixlConnector's), kept as they came. A
    worker of ours of role "both" serves such a request whole; one of role prefill or decode refuses it."""

    params: Mapping[str, Any]

    role = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.params)

    @classmethod
    def parse(cls, obj: Any) -> ForeignParams:
        obj = _mapping(obj)
        if obj.get(_ROLE) is not None:
            raise HandoffError(_ROLE, f"must be absent from another connector's params, got {obj.get(_ROLE)!r}")
        return cls(dict(obj))


LegParams = PrefillParams | DecodeParams | ForeignParams


def _expect_role(obj: Any, role: str) -> Mapping[str, Any]:
    obj = _mapping(obj)
    if obj.get(_ROLE) != role:
        raise HandoffError(_ROLE, f"must be {role!r}, got {obj.get(_ROLE)!r}")
    return obj


def parse_leg(obj: Any) -> LegParams:
    """A request's `kv_transfer_params` as a leg of ours, or as another connector's (no role)."""
    obj = _mapping(obj)
    role = obj.get(_ROLE)
    if role is None:
        return ForeignParams.parse(obj)
    if role == PREFILL:
        return PrefillParams.parse(obj)
    if role == DECODE:
        return DecodeParams.parse(obj)
    raise HandoffError(_ROLE, f"must be {PREFILL!r} or {DECODE!r}, got {role!r}")


@dataclass(frozen=True, slots=True)
class PrefillHandoff:
    """What a prefill answer's `kv_transfer_params` say: where the decode leg pulls its KV from. Each
    part may be missing (a `vllm serve` answer may say nothing); the proxy fills in from its records."""

    host: str | None = None
    port: int | None = None
    engine_id: str | None = None
    request_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        shown = {_HOST: self.host, _PORT: self.port, _ENGINE_ID: self.engine_id, _REQUEST_ID: self.request_id}
        return {key: value for key, value in shown.items() if value is not None}

    @classmethod
    def parse(cls, obj: Any) -> PrefillHandoff:
        obj = _mapping(obj)
        return cls(_opt_str(obj, _HOST), _opt_port(obj, _PORT), _opt_str(obj, _ENGINE_ID), _opt_request_id(obj))


def nixl_prefill_params() -> dict[str, Any]:
    """vLLM's NixlConnector, prefill leg: keep the KV for a remote decode (which learns where from the answer)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, _ENGINE_ID: None,
            "remote_block_ids": None, _HOST: None, _PORT: None}
