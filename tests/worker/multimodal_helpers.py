"""Test helpers for image parts: embeddings tensors and the files and urls that hold them."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from worker.multimodal.embeds import ImageEmbeds, image_embeds


def rows(n: int, hidden: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """n seeded rows on the scale of the test models' token embeddings."""
    return (torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5).to(dtype)


def embeds(n: int, hidden: int, seed: int) -> ImageEmbeds:
    return image_embeds(rows(n, hidden, seed), {}, hidden, torch.float32, "test")


def safetensors_bytes(tensor: torch.Tensor, **others: torch.Tensor) -> bytes:
    return save_safetensors({"embeddings": tensor, **others} if others else {"embeddings": tensor})


def pt_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def data_url(data: bytes) -> str:
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}
