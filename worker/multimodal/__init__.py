"""Multimodal prompts from precomputed embeddings: each image content part of a chat request names
a tensor [n, hidden_size] that fills n placeholder positions of the prompt.

    media.py        loads a part's url (a file under the allowed directory, file://, data:, http(s)) safely
    tensor_file.py  decodes the bytes (safetensors, or torch.save read with weights_only)
    embeds.py       checks the tensor against the model (shape, dtype, finite) and digests it
    prompt.py       the placeholder marker, and the prompt's token ids and image positions

The names below are imported on first use, so the chat parser can use prompt.py's marker without torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ImageEmbeds": "worker.multimodal.embeds", "image_embeds": "worker.multimodal.embeds",
    "MediaPolicy": "worker.multimodal.media", "load_part": "worker.multimodal.media",
    "MultiModalPrompt": "worker.multimodal.prompt",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'worker.multimodal' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from worker.multimodal.embeds import ImageEmbeds, image_embeds
    from worker.multimodal.media import MediaPolicy, load_part
    from worker.multimodal.prompt import MultiModalPrompt
