"""A worker's image parts of both kinds: `image_url` loaded here, `image_embeds` made by an encode worker.

A prefill worker pulls an `image_embeds` part's rows from the encode worker; a decode worker only
needs its positions and digest (it gets the prompt's KV, never its input embeddings), so it pulls
nothing; a worker of role both takes `image_url` parts only.
"""
from __future__ import annotations

import asyncio
from typing import Protocol

from worker.multimodal.fetch import EmbedsFetcher, placeholder
from worker.multimodal.ref import PART_TYPE, EmbedsRef
from worker.errors import invalid
from worker.multimodal.embeds import ImageEmbeds
from worker.multimodal.prompt import MediaPart


class _UrlResolver(Protocol):
    async def resolve(self, parts: list[MediaPart]) -> list[ImageEmbeds]: ...

    async def close(self) -> None: ...


class PartResolver:
    """Resolves every image part of a request, in order: `image_url` ones through `urls`, `image_embeds`
    ones pulled with `fetcher` (prefill) or, with `placeholders_only` (decode), as placeholders."""

    def __init__(self, urls: _UrlResolver, fetcher: EmbedsFetcher | None, placeholders_only: bool) -> None:
        self._urls = urls
        self._fetcher = fetcher
        self._placeholders_only = placeholders_only

    async def resolve(self, parts: list[MediaPart], decode_leg: bool = False) -> list[ImageEmbeds]:
        """The embeddings of each part, in order; the pulls of one request run at once. `decode_leg`: the
        request is the decode leg of a disaggregated one, whose prompt KV comes from its prefill worker."""
        refs = [self._ref(p, decode_leg) if p.type == PART_TYPE else None for p in parts]
        results = await asyncio.gather(*(self._one(p, r) for p, r in zip(parts, refs)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)  # type: ignore[arg-type]

    def _ref(self, part: MediaPart, decode_leg: bool) -> EmbedsRef:
        ref = EmbedsRef.from_dict(part.value, part.param)
        if self._fetcher is None and not (self._placeholders_only and decode_leg):
            # Placeholders are right only where the prompt's KV arrives from a prefill worker.
            raise invalid(f"{part.param}: {PART_TYPE} parts are for the prefill and decode legs of a disaggregated "
                          f"request behind an encode worker; send image_url parts here", part.param)
        if self._fetcher is not None:
            self._fetcher.check(ref, part.param)
        return ref

    async def _one(self, part: MediaPart, ref: EmbedsRef | None) -> ImageEmbeds:
        if ref is None:
            return (await self._urls.resolve([part]))[0]
        if self._fetcher is None:
            return placeholder(ref)
        return await self._fetcher.fetch(ref, part.param)

    async def close(self) -> None:
        await self._urls.close()
        if self._fetcher is not None:
            await self._fetcher.aclose()
