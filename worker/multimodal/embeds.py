"""One image's embeddings, checked against the model and identified by a digest of their bytes."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from worker.errors import invalid


@dataclass(frozen=True)
class ImageEmbeds:
    """The rows that replace an image's n placeholder positions, and what identifies them.

    `digest` is the sha256 hex over dtype, shape and bytes: equal digests mean equal rows, so the
    prefix cache may share the KV of identical images and never that of different ones.
    """

    tensor: torch.Tensor    # [n, hidden_size], the model's dtype, contiguous, on the CPU
    aux: dict[str, Any]     # JSON-able data that came with the tensor (not used by the model)
    digest: str

    @property
    def num_positions(self) -> int:
        return self.tensor.shape[0]


def image_embeds(tensor: Any, aux: dict[str, Any], hidden_size: int, dtype: torch.dtype,
                 part: str) -> ImageEmbeds:
    """Checks `tensor` is a finite [n >= 1, hidden_size] tensor of exactly `dtype` (no silent casts);
    raises InvalidRequestError naming `part` (e.g. "messages[0].content[1]") otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise invalid(f"{part}: the embeddings must be a tensor, got {type(tensor).__name__}", part)
    if tensor.dim() != 2 or tensor.shape[0] < 1 or tensor.shape[1] != hidden_size:
        raise invalid(f"{part}: the embeddings must have shape [n >= 1, {hidden_size}] (the model's hidden "
                      f"size), got {list(tensor.shape)}", part)
    if tensor.dtype != dtype:
        raise invalid(f"{part}: the embeddings must be {_name(dtype)} (the model's dtype), "
                      f"got {_name(tensor.dtype)}", part)
    tensor = tensor.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(tensor).all()):
        raise invalid(f"{part}: the embeddings contain NaN or infinite values", part)
    return ImageEmbeds(tensor, dict(aux), digest(tensor))


def digest(tensor: torch.Tensor) -> str:
    """sha256 hex over a contiguous CPU tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{_name(tensor.dtype)}{list(tensor.shape)}".encode())
    h.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_spans(mm: list[tuple[int, ImageEmbeds]], num_prompt_tokens: int, hidden_size: int,
                dtype: torch.dtype) -> tuple[tuple[int, int, str], ...]:
    """The scheduler's (start, length, digest) triples of an engine request's images, checked to be
    sorted, disjoint, inside the prompt and of the model's hidden size and dtype."""
    spans: list[tuple[int, int, str]] = []
    end = 0
    for i, (start, image) in enumerate(mm):
        if not isinstance(image, ImageEmbeds):
            raise invalid(f"mm[{i}] must be ImageEmbeds, got {type(image).__name__}", "mm")
        length = image.num_positions
        if not isinstance(start, int) or start < end or start + length > num_prompt_tokens:
            raise invalid(f"mm[{i}]: positions {start}..{start + length - 1} must lie in the prompt "
                          f"({num_prompt_tokens} tokens), after the previous image's", "mm")
        if image.tensor.shape[1] != hidden_size or image.tensor.dtype != dtype:
            raise invalid(f"mm[{i}]: embeddings of {image.tensor.shape[1]} {_name(image.tensor.dtype)} do not "
                          f"fit the model ({hidden_size} {_name(dtype)})", "mm")
        spans.append((start, length, image.digest))
        end = start + length
    return tuple(spans)
