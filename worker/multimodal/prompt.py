"""A chat prompt with images: the chat parser keeps each image part as a MediaPart and renders it as
IMAGE_MARKER, and each marker becomes n positions of PLACEHOLDER_TOKEN_ID whose input embeddings are the
image's n rows.

The placeholder's token id never reaches the model (its embedding row is replaced) nor the output
(it is only in the prompt); 0 exists in every vocabulary. The prefix cache keys blocks on the
images' digests as well as the token ids (common/block_hash.py), so equal placeholder ids
never make two different images share KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker.errors import invalid

if TYPE_CHECKING:   # the chat parser imports IMAGE_MARKER from here: no torch, no tokenizers
    from common.tokenizer import Tokenizer
    from worker.multimodal.embeds import ImageEmbeds

IMAGE_MARKER = "<|neuron_di_image|>"
PLACEHOLDER_TOKEN_ID = 0
MEDIA_PART_TYPES = ("image_url", "image_embeds")  # image_embeds: made by an encode worker (worker/encode/)


@dataclass(frozen=True)
class MediaPart:
    """A chat content part that is not text, in prompt order; the message's text holds IMAGE_MARKER in its place."""

    param: str              # where it was, e.g. "messages[0].content[1]": errors about it name this
    type: str               # one of MEDIA_PART_TYPES
    value: dict[str, Any]   # the part's object under its type, e.g. {"url": ...} for image_url


@dataclass(frozen=True)
class MultiModalPrompt:
    """Prompt token ids and, in order, each image's first position and embeddings."""

    token_ids: list[int]
    spans: list[tuple[int, ImageEmbeds]]   # (start position, embeds): positions start .. start + n - 1


def build_prompt(tokenizer: Tokenizer, text: str, images: list[ImageEmbeds]) -> MultiModalPrompt:
    """The prompt of a rendered chat `text` holding one IMAGE_MARKER per image, in order."""
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) != len(images) + 1:
        raise invalid(f"the chat template rendered {len(pieces) - 1} image placeholders for {len(images)} "
                      f"images", "messages")
    token_ids = tokenizer.encode(pieces[0], add_bos=False)
    spans: list[tuple[int, ImageEmbeds]] = []
    for piece, image in zip(pieces[1:], images):
        spans.append((len(token_ids), image))
        token_ids.extend([PLACEHOLDER_TOKEN_ID] * image.num_positions)
        token_ids.extend(tokenizer.encode(piece, add_bos=False))
    return MultiModalPrompt(token_ids, spans)
