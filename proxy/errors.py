"""Errors of the proxy, and the one place where they become HTTP statuses.

    ProxyError
    ├── ConfigError              bad command line or configuration; the proxy does not start
    ├── BadRequest               the client's request is invalid (400)
    ├── NoWorkers                no healthy worker of a role (and kv_protocol) right now (503)
    ├── ShuttingDown             the proxy is shutting down; a stream still open ends with it (503)
    ├── QueueUnavailable         the global prefill queue (NATS) cannot be reached (503)
    └── UpstreamError            a worker failed one leg of a request
        ├── UpstreamStatus       the worker answered with an error status (4xx passed on, 5xx -> 502; a
        │                        failed KV transfer keeps its type, and a 503 its status and Retry-After;
        │                        a draining worker's 503 is first sent on to the role's other workers)
        ├── UpstreamTimeout      connecting to or reading from the worker timed out (504)
        ├── UpstreamUnavailable  the worker refused the connection or dropped it mid-answer (502; a
        │                        refused connection is first sent on to the role's other workers)
        ├── WorkerLost           the worker left the pool or failed its health check mid-answer (502)
        └── UpstreamProtocol     the worker's answer is not the JSON / SSE it should be (502)
"""
from __future__ import annotations

import json
from typing import Any

from common.openai_wire import WORKER_DRAINING, error_body, json_bytes

KV_TRANSFER_ERROR = "kv_transfer_error"  # a worker's error type: decode could not pull the prompt's KV


class ProxyError(Exception):
    """Base class of every error the proxy raises."""


class ConfigError(ProxyError):
    pass


class BadRequest(ProxyError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NoWorkers(ProxyError):
    """`reasons`: why each known worker of the role is out of rotation ("prefill worker HOST:PORT: why")."""

    def __init__(self, role: str, kv_protocol: str | None = None, reasons: tuple[str, ...] = ()) -> None:
        driven = f" with kv_protocol {kv_protocol!r}" if kv_protocol else ""
        super().__init__("; ".join((f"no healthy {role} worker{driven} is available", *reasons)))
        self.role = role
        self.kv_protocol = kv_protocol


class ShuttingDown(ProxyError):
    pass


class QueueUnavailable(ProxyError):
    pass


class UpstreamError(ProxyError):
    """A leg failed; `role` is the leg ("prefill", "decode", "both") and `worker` its address."""

    def __init__(self, message: str, role: str = "", worker: str = "") -> None:
        super().__init__(f"{role} worker {worker}: {message}" if worker else message)
        self.role = role
        self.worker = worker


class UpstreamStatus(UpstreamError):
    """`retry_after`: the worker's Retry-After header, if it sent one."""

    def __init__(self, status: int, body: bytes, role: str = "", worker: str = "",
                 retry_after: str | None = None) -> None:
        self.status = status
        self.body = body
        self.retry_after = retry_after
        said = self.error.get("message")
        super().__init__(f"answered HTTP {status}" + (f": {said}" if isinstance(said, str) and said else ""),
                         role, worker)

    @property
    def draining(self) -> bool:
        """The worker drains and refused the request before starting it: another worker may take it."""
        return self.status == 503 and self.error.get("type") == WORKER_DRAINING

    @property
    def error(self) -> dict[str, Any]:
        """The worker's OpenAI error object; empty if the body is not one."""
        try:
            error = json.loads(self.body).get("error")
        except (ValueError, AttributeError):
            return {}
        return error if isinstance(error, dict) else {}


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamUnavailable(UpstreamError):
    """`refused`: the connection itself was refused, so nothing of the leg reached the worker."""

    def __init__(self, message: str, role: str = "", worker: str = "", refused: bool = False) -> None:
        super().__init__(message, role, worker)
        self.refused = refused


def nothing_started(exc: BaseException) -> bool:
    """Whether a failed leg never started on its worker (a draining worker refused it, or nothing listened
    there any more), so that another worker of its role may take it."""
    return ((isinstance(exc, UpstreamStatus) and exc.draining)
            or (isinstance(exc, UpstreamUnavailable) and exc.refused))


class UpstreamProtocol(UpstreamError):
    pass


class WorkerLost(UpstreamError):
    pass


def to_http(exc: ProxyError) -> tuple[int, bytes, dict[str, str]]:
    """Maps an error to (HTTP status, JSON body, headers); the only place statuses are decided."""
    if isinstance(exc, UpstreamStatus) and 400 <= exc.status < 500:
        # The worker judged the request itself: the client gets the worker's own answer.
        return exc.status, exc.body or json_bytes(error_body(exc.status, str(exc), "invalid_request_error")), {}
    if isinstance(exc, UpstreamStatus) and exc.error.get("type") == KV_TRANSFER_ERROR:
        return _kv_transfer_error(exc)
    if isinstance(exc, BadRequest):
        status, err_type, param = 400, "invalid_request_error", exc.param
    elif isinstance(exc, (NoWorkers, ShuttingDown, QueueUnavailable)):
        status, err_type, param = 503, "service_unavailable", None
    elif isinstance(exc, UpstreamTimeout):
        status, err_type, param = 504, "upstream_timeout", None
    elif isinstance(exc, UpstreamError):
        status, err_type, param = 502, "upstream_error", None
    else:
        status, err_type, param = 500, "internal_error", None
    return status, json_bytes(error_body(status, str(exc), err_type, param)), {}


def _kv_transfer_error(exc: UpstreamStatus) -> tuple[int, bytes, dict[str, str]]:
    """Decode could not pull the prompt's KV: the client learns that (the worker's message names the prefill
    peer and why), and, as the worker said with its 503 and Retry-After, whether sending it again may work."""
    status = 503 if exc.status == 503 else 502
    message = f"{exc.role} worker {exc.worker}: {exc.error.get('message')}"
    headers = {"Retry-After": exc.retry_after} if exc.retry_after else {}
    return status, json_bytes(error_body(status, message, KV_TRANSFER_ERROR)), headers
