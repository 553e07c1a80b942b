"""Image parts of a chat request, turned into the embeddings the model takes: each part either names a
tensor [n, hidden_size] (`image_url`) or stands for rows an encode worker holds (`image_embeds`); its n
rows fill n placeholder positions of the prompt.

    prompt.py       the chat parser's MediaPart, the placeholder marker, the prompt's token ids and image positions
    media.py        loads a part's url (a file under the allowed directory, file://, data:, http(s)) safely
    tensor_file.py  decodes the bytes (safetensors, or torch.save read with weights_only)
    embeds.py       checks the tensor against the model (shape, dtype, finite) and digests it
    images.py       `image_url` parts: loaded and checked, one download client per server
    ref.py          EmbedsRef: the metadata an encode worker answers with (shape, dtype, aux, digest, where)
    rows.py         a registered region of embedding rows with a contiguous-range allocator (encode and prefill)
    fetch.py        prefill side: pulls the rows of an EmbedsRef into its own region
    parts.py        PartResolver: a request's parts of both kinds (image_url loaded, image_embeds pulled)
    flags.py        the command-line flags of the rows' region
    errors.py       the embeddings transfer's errors

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
