"""Embeddings files for tests: [n, hidden] tensors of the built-in model's shape, saved as a client would."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.worker.multimodal_helpers import pt_bytes, rows as model_rows, safetensors_bytes, write
from worker.model.loader import builtin_model_path, load_config

HIDDEN = load_config(builtin_model_path()).hidden_size


def rows(n: int, seed: int, hidden: int = HIDDEN) -> torch.Tensor:
    # Small rows: the built-in code model then still continues the text after an image with code, so
    # comparing answers compares printable text, not runs of U+FFFD.
    return model_rows(n, hidden, seed) * 0.1


def write_images(directory: Path, counts: list[int], first_seed: int = 0) -> list[Path]:
    """One file per count, seeded by first_seed + its index: .safetensors and .pt (a dict with aux data) in turn."""
    paths = []
    for i, n in enumerate(counts):
        seed = first_seed + i
        if i % 2:
            data = pt_bytes({"embeddings": rows(n, seed), "image_size": [32, 32 + i]})
            paths.append(write(directory / f"image{seed}.pt", data))
        else:
            paths.append(write(directory / f"image{seed}.safetensors", safetensors_bytes(rows(n, seed))))
    return paths
