"""Resolving a chat request's media parts into the embeddings the engine's model takes."""
from __future__ import annotations

import torch

from worker.errors import invalid
from worker.multimodal.embeds import ImageEmbeds, image_embeds
from worker.multimodal.media import MediaPolicy, download_client, load_part
from worker.multimodal.prompt import MediaPart


class ImageResolver:
    """Loads and checks each image part against the model; one download client for the server's life."""

    def __init__(self, policy: MediaPolicy, hidden_size: int, dtype: torch.dtype) -> None:
        self.policy = policy
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._client = download_client()

    async def resolve(self, parts: list[MediaPart]) -> list[ImageEmbeds]:
        """The embeddings of each part, in order; InvalidRequestError naming the first bad part."""
        return [await self._one(part) for part in parts]

    async def _one(self, part: MediaPart) -> ImageEmbeds:
        url = part.value.get("url")
        if not isinstance(url, str):
            raise invalid(f"{part.param}: `image_url.url` must be a string", part.param)
        tensor, aux = await load_part(url, self.policy, part.param, self._client)
        return image_embeds(tensor, aux, self.hidden_size, self.dtype, part.param)

    async def close(self) -> None:
        await self._client.aclose()
