"""Prefill side: the rows an EmbedsRef points at, pulled into this worker's own registered region.

The encode worker is asked over HTTP to push the rows (never sent in the HTTP body) into a slot
of our region through the transfer engine; they are copied out of the slot, which is freed at
once. The rows are not checked again: the encode worker checked them (shape, dtype, finite values)
and digested these very bytes, and the transfer engine delivers them whole or fails; a second
check would cost more than the pull itself.
"""
from __future__ import annotations

import asyncio

import httpx
import torch

from worker.multimodal.errors import EmbedsTransferError
from worker.multimodal.ref import EmbedsRef
from worker.multimodal.rows import RowRegion, Slot
from worker.errors import invalid
from worker.multimodal.embeds import ImageEmbeds

_ANSWER_MARGIN_S = 10.0


class EmbedsFetcher:
    """Pulls image embeddings for one worker; create and close it inside the serving event loop."""

    def __init__(self, region: RowRegion, timeout: float = 30.0) -> None:
        self.region = region
        # Longer than the encode worker's own limit on a push (--kv-pull-timeout), so that a slot is
        # freed only once the encode worker has answered: its push never lands in a reused slot.
        self._client = httpx.AsyncClient(timeout=timeout + _ANSWER_MARGIN_S)

    def check(self, ref: EmbedsRef, part: str) -> None:
        """InvalidRequestError (400, naming `part`) unless the rows fit this worker's model."""
        hidden, dtype = self.region.hidden_size, self.region.dtype
        if ref.shape[1] != hidden or ref.torch_dtype != dtype:
            raise invalid(f"{part}: embeddings of shape {list(ref.shape)} {ref.dtype} do not fit the model "
                          f"(hidden size {hidden}, {str(dtype).removeprefix('torch.')})", part)

    async def fetch(self, ref: EmbedsRef, part: str) -> ImageEmbeds:
        """The embeddings of content part `part`; EmbedsTransferError if they cannot be pulled."""
        self.check(ref, part)
        slot = self.region.reserve(ref.num_rows)
        # A request cancelled meanwhile (its client left) does not end the pull: the slot stays taken
        # until the encode worker has answered, since until then its push may still write into it.
        pull = asyncio.ensure_future(self._pull_into(slot, ref, part))
        pull.add_done_callback(_consume)
        return await asyncio.shield(pull)

    async def _pull_into(self, slot: Slot, ref: EmbedsRef, part: str) -> ImageEmbeds:
        try:
            await self._pull(ref, part, slot.first)
            return ImageEmbeds(slot.rows.clone(), dict(ref.aux), ref.digest)
        finally:
            self.region.release(slot)

    async def _pull(self, ref: EmbedsRef, part: str, first_block: int) -> None:
        body = {"handle": ref.handle, "num_rows": ref.num_rows, "first_block": first_block,
                "descriptor": self.region.descriptor()}
        try:
            reply = await self._client.post(f"{ref.url}/v1/embeds/pull", json=body)
        except httpx.HTTPError as exc:
            raise EmbedsTransferError(f"{part}: encode worker {ref.url} is unreachable "
                                      f"({type(exc).__name__}: {exc})") from exc
        if reply.status_code != 200:
            raise EmbedsTransferError(f"{part}: encode worker {ref.url} could not send the embeddings "
                                      f"(HTTP {reply.status_code}: {_message(reply)})")

    async def aclose(self) -> None:
        await self._client.aclose()
        await asyncio.to_thread(self.region.close)


def placeholder(ref: EmbedsRef) -> ImageEmbeds:
    """Embeddings that carry the shape and digest of `ref` and no rows (a stride-0 view of one zero):
    a decode worker needs the positions and digests of the image, never its rows."""
    rows = torch.zeros((), dtype=ref.torch_dtype).expand(ref.shape)
    return ImageEmbeds(tensor=rows, aux=ref.aux, digest=ref.digest)


def _consume(task: asyncio.Future) -> None:
    """Marks the outcome of a pull nobody awaits any more as seen."""
    if not task.cancelled():
        task.exception()


def _message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:200]
