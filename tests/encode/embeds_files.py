"""Embeddings files for tests, written as examples/epd.py writes them, of the built-in model's hidden size."""
from __future__ import annotations

from pathlib import Path

import torch

from examples.epd import image_rows, write_images as write_model_images
from worker.model.loader import builtin_model_path, load_config

HIDDEN = load_config(builtin_model_path()).hidden_size


def rows(n: int, seed: int, hidden: int = HIDDEN) -> torch.Tensor:
    return image_rows(n, seed, hidden)


def write_images(directory: Path, counts: list[int], first_seed: int = 0) -> list[Path]:
    return write_model_images(directory, counts, first_seed, HIDDEN)
