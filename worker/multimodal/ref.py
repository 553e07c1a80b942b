"""The metadata an encode worker answers with for one image part: never the rows themselves.

    {"shape": [n, hidden], "dtype": "float32", "aux": {...}, "digest": "<sha256 hex>",
     "source": {"url": "http://host:port", "handle": "<hex>", "transfer_id": "<engine id>"}}

`source` says where the rows wait: the encode worker's HTTP address (a pull is asked for there)
and the handle of the rows in its registered region.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from worker.errors import invalid

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PART_TYPE = "image_embeds"


@dataclass(frozen=True, slots=True)
class EmbedsRef:
    """Where one image part's embedding rows wait to be pulled, and what they are."""

    shape: tuple[int, int]
    dtype: str
    digest: str
    url: str
    handle: str
    transfer_id: str
    aux: dict[str, Any] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.shape[0]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "aux": self.aux, "digest": self.digest,
                "source": {"url": self.url, "handle": self.handle, "transfer_id": self.transfer_id}}

    @classmethod
    def from_dict(cls, data: Any, part: str) -> EmbedsRef:
        """Checks the metadata of content part `part`; InvalidRequestError (400) names what is wrong."""
        param = f"{part}.{PART_TYPE}"
        if not isinstance(data, dict) or not isinstance(data.get("source"), dict):
            raise invalid(f"{param} must be an object with shape, dtype, aux, digest and source", param)
        shape, source = data.get("shape"), data["source"]
        if (not isinstance(shape, list) or len(shape) != 2
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise invalid(f"{param}.shape must be two positive integers, got {shape!r}", param)
        if data.get("dtype") not in DTYPES:
            raise invalid(f"{param}.dtype must be one of {sorted(DTYPES)}, got {data.get('dtype')!r}", param)
        texts = {"digest": data.get("digest"), "source.url": source.get("url"),
                 "source.handle": source.get("handle"), "source.transfer_id": source.get("transfer_id")}
        for name, value in texts.items():
            if not isinstance(value, str) or not value:
                raise invalid(f"{param}.{name} must be a non-empty string", param)
        aux = data.get("aux", {})
        if not isinstance(aux, dict):
            raise invalid(f"{param}.aux must be an object", param)
        return cls((shape[0], shape[1]), data["dtype"], data["digest"], source["url"], source["handle"],
                   source["transfer_id"], aux)
