"""Decoding an embeddings file (safetensors, or torch.save read with weights_only) into a tensor
and JSON-able auxiliary data; never unpickles anything but tensors and plain containers."""
from __future__ import annotations

import io
import json
import struct
from typing import Any

import safetensors.torch
import torch

from worker.errors import invalid

EMBEDDINGS_KEY = "embeddings"


def decode_tensor_file(data: bytes, part: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """The embeddings tensor in `data` and the aux data next to it: a lone tensor, or a dict / safetensors
    file holding it under "embeddings" (other tensors become lists; safetensors metadata is kept too)."""
    if _looks_like_safetensors(data):
        try:
            tensors: dict[str, Any] = safetensors.torch.load(data)
        except Exception as exc:  # the safetensors library raises its own SafetensorError and others
            raise invalid(f"{part}: malformed safetensors file: {_first_line(exc)}", part) from exc
        metadata = json.loads(data[8:8 + _header_len(data)]).get("__metadata__") or {}
        obj: Any = next(iter(tensors.values())) if len(tensors) == 1 else {**metadata, **tensors}
        return _split(obj, part, metadata if len(tensors) == 1 else {})
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError for arbitrary objects, RuntimeError for bad archives
        raise invalid(f"{part}: not a safetensors or torch tensor file (only tensors and plain containers "
                      f"are loaded): {_first_line(exc)}", part) from exc
    return _split(obj, part, {})


def _split(obj: Any, part: str, aux: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    if isinstance(obj, torch.Tensor):
        return obj, aux
    if not isinstance(obj, dict) or not isinstance(obj.get(EMBEDDINGS_KEY), torch.Tensor):
        raise invalid(f"{part}: the file must hold a tensor, or a dict with the tensor under "
                      f"{EMBEDDINGS_KEY!r}", part)
    extra = {str(k): v.tolist() if isinstance(v, torch.Tensor) else v
             for k, v in obj.items() if k != EMBEDDINGS_KEY}
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise invalid(f"{part}: the auxiliary data next to the embeddings must be JSON-able: {exc}", part) from exc
    return obj[EMBEDDINGS_KEY], {**aux, **extra}


def _header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def _looks_like_safetensors(data: bytes) -> bool:
    # 8 bytes of little-endian header length, then the JSON header; torch.save writes a zip or a pickle.
    return len(data) >= 10 and 2 <= _header_len(data) <= len(data) - 8 and data[8:9] == b"{"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
