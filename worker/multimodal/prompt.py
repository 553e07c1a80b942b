"""A chat prompt with images: the template renders each image part as IMAGE_MARKER, and each marker
becomes n positions of PLACEHOLDER_TOKEN_ID whose input embeddings are the image's n rows.

The placeholder's token id never reaches the model (its embedding row is replaced) nor the output
(it is only in the prompt); 0 exists in every vocabulary. The prefix cache keys blocks on the
images' digests as well as the token ids (scheduler/block_manager.py), so equal placeholder ids
never make two different images share KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.errors import invalid

if TYPE_CHECKING:   # the chat parser imports IMAGE_MARKER from here: no torch, no tokenizers
    from common.tokenizer import Tokenizer
    from worker.multimodal.embeds import ImageEmbeds

IMAGE_MARKER = "<|neuron_di_image|>"
PLACEHOLDER_TOKEN_ID = 0


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
