"""The encode step: a chat request's image parts become embeddings on an encode worker first.

The encode worker loads and checks each `image_url` part and keeps its rows for a prefill worker
to pull; it answers with metadata only, which replaces the part as `{"type": "image_embeds", ...}`.
Both legs then get the same body. Without encode workers in the pool, requests pass unchanged
(the prefill and decode workers load the images themselves).
"""
from __future__ import annotations

import copy
import uuid
from dataclasses import replace
from typing import Any, Callable

from common.roles import ENCODE_ROLE
from proxy.errors import UpstreamProtocol, UpstreamStatus
from proxy.requests import ClientRequest
from proxy.upstream import Upstream
from proxy.workers import WorkerPool, WorkerRecord

IMAGE_PART = "image_url"
EMBEDS_PART = "image_embeds"


def image_parts(body: dict[str, Any]) -> list[tuple[int, int, str]]:
    """(message index, part index, url) of every well-formed image part of a chat body, in order (a
    malformed one is left for the prefill worker to refuse, naming it)."""
    found = []
    for i, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            image = part.get(IMAGE_PART) if isinstance(part, dict) and part.get("type") == IMAGE_PART else None
            if isinstance(image, dict):
                found.append((i, j, image.get("url")))
    return found


def with_embeds(body: dict[str, Any], parts: list[tuple[int, int, str]], metas: list[Any]) -> dict[str, Any]:
    """A copy of `body` whose image parts are replaced by their embeddings' metadata."""
    fresh = {**body, "messages": copy.deepcopy(body["messages"])}
    for (i, j, _), meta in zip(parts, metas):
        fresh["messages"][i]["content"][j] = {"type": EMBEDS_PART, EMBEDS_PART: meta}
    return fresh


async def encode_images(request: ClientRequest, pool: WorkerPool,
                        clients: Callable[[WorkerRecord], Upstream]) -> ClientRequest:
    """`request` with its image parts encoded by the next encode worker; unchanged if it has none or the
    pool knows no encode worker. A worker's 4xx is the client's answer (it names the part); any other
    failure is an UpstreamError (502/504)."""
    parts = image_parts(request.body) if request.endpoint.is_chat else []
    if not parts or not any(w.role == ENCODE_ROLE for w in pool.all()):
        return request
    worker = pool.next(ENCODE_ROLE)
    payload = {"parts": [{"part": f"messages[{i}].content[{j}]", "url": url} for i, j, url in parts]}
    reply = await clients(worker).post("/v1/encode", payload, {"X-Request-Id": uuid.uuid4().hex})
    if reply.status != 200:
        raise UpstreamStatus(reply.status, reply.body, ENCODE_ROLE, worker.address, reply.retry_after)
    try:
        metas = reply.json()["parts"]
        if not isinstance(metas, list) or len(metas) != len(parts):
            raise ValueError(f"{len(metas)} parts for {len(parts)} images")
    except (ValueError, KeyError, TypeError) as exc:
        raise UpstreamProtocol(f"bad encode answer: {exc}", ENCODE_ROLE, worker.address) from exc
    return replace(request, body=with_embeds(request.body, parts, metas))
