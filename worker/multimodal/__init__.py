"""Multimodal prompts from precomputed embeddings: each image content part of a chat request names
a tensor [n, hidden_size] that fills n placeholder positions of the prompt.

    media.py     loads a part's url (a file under the allowed directory, file://, data:, http(s)) safely
    embeds.py    checks the tensor against the model (shape, dtype, finite) and digests it
    prompt.py    renders the chat with placeholders and places the embeddings at their positions
"""
from __future__ import annotations

from worker.multimodal.embeds import ImageEmbeds, image_embeds
from worker.multimodal.media import MediaPolicy, load_part
from worker.multimodal.prompt import MultiModalPrompt

__all__ = ["ImageEmbeds", "MediaPolicy", "MultiModalPrompt", "image_embeds", "load_part"]
