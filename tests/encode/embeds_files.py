"""Embeddings files for tests: [n, hidden] tensors of the built-in model's shape, saved as a client would."""
from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch

from worker.model.loader import builtin_model_path, load_config

HIDDEN = load_config(builtin_model_path()).hidden_size


def rows(n: int, seed: int, hidden: int = HIDDEN, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def write_images(directory: Path, counts: list[int], first_seed: int = 0) -> list[Path]:
    """One file per count: .safetensors and .pt (a dict with aux data) in turn."""
    paths = []
    for i, n in enumerate(counts):
        tensor = rows(n, first_seed + i)
        if i % 2:
            path = directory / f"image{first_seed + i}.pt"
            torch.save({"embeddings": tensor, "image_size": [32, 32 + i]}, path)
        else:
            path = directory / f"image{first_seed + i}.safetensors"
            safetensors.torch.save_file({"embeddings": tensor}, path)
        paths.append(path)
    return paths


def image_part(path: Path) -> dict:
    return {"type": "image_url", "image_url": {"url": f"file://{path}"}}
