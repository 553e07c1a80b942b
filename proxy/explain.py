"""Why a `vllm serve` decode worker failed a leg.

vLLM answers a request whose KV load failed with a bare HTTP 500 ("Internal server error"). Its
NeuronConnector knows why (the pull's error names the prefill peer: no handshake before the
deadline, the peer forgot the request, the prefill leg it sent failed, ...) and shows it on its
status server (`GET /timeline?uid=`). A decode leg that fails with a 5xx on a worker with a
status port is looked up there: a failed pull becomes the `kv_transfer_error` our own decode
worker would have answered (503, Retry-After), any other failure stays what it was. vLLM may also
fail a stream it already answered 200: its error event is looked up the same way.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Callable

from common.openai_wire import error_body, json_bytes
from proxy.errors import KV_TRANSFER_ERROR, UpstreamError, UpstreamStatus
from proxy.upstream import Upstream
from proxy.workers import WorkerRecord

log = logging.getLogger("proxy.explain")
LOOKUP_TIMEOUT_S = 2.0


async def explained(exc: UpstreamStatus, worker: WorkerRecord, uid: str | None,
                    clients: Callable[[WorkerRecord], Upstream]) -> UpstreamStatus:
    """`exc`, or the kv_transfer_error it stands for when the worker's connector says its pull failed."""
    if (exc.status < 500 or worker.role != "decode" or not worker.status_port or uid is None
            or exc.error.get("type") == KV_TRANSFER_ERROR):
        return exc
    status = replace(worker, host=worker.kv_host, http_port=worker.status_port)
    try:
        reply = await clients(status).get(f"/timeline?uid={uid}", LOOKUP_TIMEOUT_S)
        records = json.loads(reply.body)["requests"] if reply.status == 200 else []
        error = records[0].get("error") if records else None
    except (UpstreamError, ValueError, KeyError, TypeError, AttributeError) as lookup:
        log.warning("decode worker %s: no status for request %s at %s: %s", worker.address, uid,
                    status.address, lookup)
        return exc
    if not error:
        return exc
    body = json_bytes(error_body(503, f"KV transfer of request {uid!r} failed: {error}", KV_TRANSFER_ERROR))
    return UpstreamStatus(503, body, exc.role, exc.worker, retry_after="1")


def stream_error_status(data: str) -> int | None:
    """The status of an SSE payload that is an OpenAI error object (vLLM ends a stream that failed after
    its 200 with one), e.g. `{"error": {"message": ..., "code": 500}}`; None for any other payload."""
    if not data.startswith('{"error"'):
        return None
    try:
        code = json.loads(data)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return code if isinstance(code, int) and 400 <= code < 600 else 500
