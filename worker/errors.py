"""Errors of the reference worker engine.

    WorkerError
    ├── InvalidRequestError   bad prompt or sampling params, duplicate id, can never fit
    ├── QueueFullError        the bounded waiting queue is full; retry later
    ├── DrainingError         the worker is draining: it takes no new request; another worker will
    │   ├── StreamHandedBack  it ended a running stream early, for the proxy to resume on another worker
    │   └── OtherRoleError    a leg of the other disaggregated role: the worker changed role since it was picked
    ├── ModelLoadError        the model directory is missing, malformed or unsupported
    └── KVTransferError       disaggregated serving: the prompt's KV could not be moved
        └── RemotePrefillError    decode_first: the prefill leg this decode worker sent failed (502, or 503
                                  when the prefill worker answered 503)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.handoff import PrefillHandoff


class WorkerError(Exception):
    """Base class of every error the engine raises."""


class InvalidRequestError(WorkerError, ValueError):
    pass


class QueueFullError(WorkerError):
    pass


class DrainingError(WorkerError):
    pass


class StreamHandedBack(DrainingError):
    """`kv`: where the worker that resumes the stream pulls its KV from (None: it recomputes it)."""

    def __init__(self, message: str, kv: PrefillHandoff | None = None) -> None:
        super().__init__(message)
        self.kv = kv


class OtherRoleError(DrainingError):
    """A prefill leg reached a decode worker or a decode leg a prefill worker: it changed role after the proxy
    picked it. Refused before starting (503), as a draining worker refuses, so a worker of the leg's role takes it."""


class ModelLoadError(WorkerError):
    pass


class KVTransferError(WorkerError):
    """`retryable`: sending the request again may succeed (the prefill peer was slow, unreachable or restarted)."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class RemotePrefillError(KVTransferError):
    """The prefill worker a decode worker asked for the prompt's KV failed; the message names it."""


def invalid(message: str, param: str | None = None) -> InvalidRequestError:
    """An InvalidRequestError naming the offending body field (shown as `param` in the error body)."""
    error = InvalidRequestError(message)
    error.param = param  # type: ignore[attr-defined]
    return error
