"""The id of a worker's HTTP request: `X-Request-Id` when the client sends one (the proxy sends one id on
every leg of a request), else a fresh one; it is `g.request_id` while the request is served, and it is
echoed on the response. Both worker apps use it: the OpenAI server and the encode server."""
from __future__ import annotations

import uuid

from quart import Quart, Response, g, request

REQUEST_ID_HEADER = "X-Request-Id"


def use_request_ids(app: Quart) -> None:
    """Every request of `app` gets its id before its handler runs; every response carries it."""
    app.before_request(take_request_id)
    app.after_request(echo_request_id)


async def take_request_id() -> None:
    g.request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


async def echo_request_id(response: Response) -> Response:
    if "request_id" in g:
        response.headers[REQUEST_ID_HEADER] = g.request_id
    return response
