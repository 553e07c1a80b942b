"""The encode worker's HTTP server: image parts in, their rows kept in a registered region, metadata out.

    POST /v1/encode        {"parts": [{"part": "messages[0].content[1]", "url": ...}, ...]}
                           -> {"parts": [EmbedsRef, ...]} in the same order; a bad part is a 400 naming it
    POST /v1/embeds/pull   {"handle", "num_rows", "first_block", "descriptor"}: pushes the rows of `handle`
                           through the transfer engine into blocks from `first_block` of the caller's region
                           (its `descriptor`), then frees them; 200 once they landed
    GET  /health           200 with this worker's record under `worker`

Rows nobody pulls are freed after the store's timeout. No model forward pass runs here: the
worker only needs the model's hidden size and dtype to check the parts.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from quart import Quart, Response, g, jsonify

from common.openai_wire import error_body, load_object
from common.request_body import DrainingRequest, request_body
from common.worker_record import WorkerRecord
from transfer import TransferError
from worker.multimodal.errors import EmbedsTransferError, UnknownHandle
from worker.multimodal.ref import EmbedsRef
from worker.multimodal.rows import RowRegion
from worker.encode.store import EmbedsStore
from worker.errors import invalid
from worker.multimodal.embeds import image_embeds
from worker.multimodal.media import MediaPolicy, download_client, load_part
from worker.server.request_id import use_request_ids
from worker.server.protocol import error_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EncodeSettings:
    """What the encode worker needs: the model's row shape, where media may come from, the region's size."""

    hidden_size: int
    dtype: torch.dtype
    media: MediaPolicy
    transport: str = "auto"
    transfer_host: str = "127.0.0.1"
    capacity_rows: int = 65536
    ttl: float = 60.0
    pull_timeout: float = 30.0
    secret: bytes | None = None


def create_encode_app(settings: EncodeSettings, base_url: str) -> Quart:
    """The app; its region is made in `before_serving` and freed in `after_serving`. `base_url` is where
    prefill workers reach it (it goes into every EmbedsRef)."""
    app = Quart(__name__)
    app.request_class = DrainingRequest
    worker = _EncodeWorker(settings, base_url)
    app.before_serving(worker.startup)
    app.after_serving(worker.shutdown)
    use_request_ids(app)
    app.register_error_handler(Exception, worker.error)
    app.add_url_rule("/v1/encode", "encode", worker.encode, methods=["POST"])
    app.add_url_rule("/v1/embeds/pull", "pull", worker.pull, methods=["POST"])
    app.add_url_rule("/health", "health", worker.health, methods=["GET"])
    app.extensions["neuron_di_encode"] = worker
    return app


class _EncodeWorker:
    """The app's state: the region of rows, the store of rows waiting for a pull, and the route handlers."""

    def __init__(self, settings: EncodeSettings, base_url: str) -> None:
        self.settings = settings
        self.base_url = base_url
        self.store: EmbedsStore | None = None
        self.record: WorkerRecord | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._downloads: Any = None  # httpx.AsyncClient for http(s) parts, made in the serving loop

    async def startup(self) -> None:
        s = self.settings
        region = await asyncio.to_thread(RowRegion, s.transport, s.transfer_host, s.hidden_size, s.dtype,
                                         s.capacity_rows, s.secret)
        self.store = EmbedsStore(region, s.ttl)
        self._downloads = download_client()
        self._sweeper = asyncio.create_task(self._sweep())

    async def shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._downloads is not None:
            await self._downloads.aclose()
        if self.store is not None:
            self.store.region.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.settings.ttl / 4))
            if freed := self.store.sweep():  # type: ignore[union-attr]
                logger.warning("freed the rows of %d image parts nobody pulled within %gs", freed, self.settings.ttl)

    async def health(self) -> Response:
        body: dict[str, Any] = {"status": "ok", "draining": False, "held_parts": len(self.store or ())}
        if self.record is not None:
            body["worker"] = self.record.to_dict()
        return jsonify(body)

    async def encode(self) -> Response:
        body = load_object(await request_body())
        parts = body.get("parts")
        if not isinstance(parts, list) or not parts:
            raise invalid("'parts' must be a non-empty list of {part, url} objects", "parts")
        made: list[str] = []
        refs = []
        try:
            for i, item in enumerate(parts):
                refs.append(await self._encode_one(item, f"parts[{i}]", made))
        except BaseException:
            self.store.discard(made)  # type: ignore[union-attr]
            raise
        return jsonify({"parts": [ref.to_dict() for ref in refs]})

    async def _encode_one(self, item: Any, where: str, made: list[str]) -> EmbedsRef:
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object with a string 'url'", where)
        part = item["part"] if isinstance(item.get("part"), str) else where
        if not isinstance(item.get("url"), str):
            raise invalid(f"{part}: the image url must be a string", part)
        s, store = self.settings, self.store
        assert store is not None
        tensor, aux = await load_part(item["url"], s.media, part, self._downloads)
        embeds = image_embeds(tensor, aux, s.hidden_size, s.dtype, part)
        handle = await asyncio.to_thread(store.put, embeds.tensor)
        made.append(handle)
        return EmbedsRef((embeds.tensor.shape[0], s.hidden_size), str(s.dtype).removeprefix("torch."),
                         embeds.digest, self.base_url, handle, store.region.engine.transfer_id, embeds.aux)

    async def pull(self) -> Response:
        body = load_object(await request_body())
        handle, num_rows, first = body.get("handle"), body.get("num_rows"), body.get("first_block")
        if not isinstance(handle, str) or not isinstance(num_rows, int) or not isinstance(first, int):
            raise invalid("a pull needs 'handle' (string), 'num_rows' and 'first_block' (integers)")
        if not isinstance(body.get("descriptor"), dict):
            raise invalid("a pull needs the caller's transfer 'descriptor'", "descriptor")
        store = self.store
        assert store is not None
        slot = store.take(handle)
        try:  # pulled or failed, the rows are freed: a failed request is not pulled again
            if slot.rows.shape[0] != num_rows or store.region.blocks_for(num_rows) != slot.count:
                raise invalid(f"handle {handle} holds {slot.rows.shape[0]} rows, not {num_rows}", "num_rows")
            await asyncio.to_thread(self._push, slot, body["descriptor"], first)
        finally:
            store.free(slot)
        return jsonify({"status": "ok"})

    def _push(self, slot: Any, descriptor: dict[str, Any], first_block: int) -> None:
        timeout = self.settings.pull_timeout
        try:
            self.store.region.push(slot, descriptor, first_block, timeout).wait(timeout)  # type: ignore[union-attr]
        except TransferError as exc:
            raise EmbedsTransferError(f"pushing {slot.rows.shape[0]} embedding rows failed: {exc}") from exc

    async def error(self, exc: Exception) -> Response:
        if isinstance(exc, UnknownHandle):
            status, body = 404, error_body(404, str(exc), "not_found_error")
        else:
            status, body, _ = error_for(exc)
        if status >= 500:
            logger.error("request %s failed", g.get("request_id"), exc_info=exc)
        response = jsonify(body)
        response.status_code = status
        return response

