"""Encode side: embedding rows waiting in the registered region until a prefill worker pulls them.

Each entry is pulled at most once; a pull frees it, and so does its timeout (a request whose
prefill leg never came). Nothing else holds rows, so an empty store means a fully free region.
"""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

import torch

from worker.multimodal.errors import UnknownHandle
from worker.multimodal.rows import RowRegion, Slot


@dataclass(frozen=True, slots=True)
class _Entry:
    slot: Slot
    expires: float


class EmbedsStore:
    """Rows by handle, in `region`, each freed when taken or `ttl` seconds after it was put."""

    def __init__(self, region: RowRegion, ttl: float) -> None:
        self.region = region
        self._ttl = ttl
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, rows: torch.Tensor) -> str:
        """Copies `rows` into the region; returns their handle. RegionFull when they do not fit."""
        self.sweep()
        slot = self.region.reserve(rows.shape[0])
        slot.rows.copy_(rows)
        handle = secrets.token_hex(12)
        with self._lock:
            self._entries[handle] = _Entry(slot, time.monotonic() + self._ttl)
        return handle

    def take(self, handle: str) -> Slot:
        """The slot of `handle`, no longer in the store: the caller frees it with `free`."""
        with self._lock:
            entry = self._entries.pop(handle, None)
        if entry is None:
            raise UnknownHandle(f"no embeddings under handle {handle!r}: pulled already, timed out, or never made")
        return entry.slot

    def free(self, slot: Slot) -> None:
        self.region.release(slot)

    def discard(self, handles: list[str]) -> None:
        """Frees the entries of `handles` still held (a request that failed half way)."""
        for handle in handles:
            try:
                self.free(self.take(handle))
            except UnknownHandle:
                pass

    def sweep(self) -> int:
        """Frees the entries past their timeout; returns how many."""
        now = time.monotonic()
        with self._lock:
            expired = [h for h, e in self._entries.items() if e.expires <= now]
            slots = [self._entries.pop(h).slot for h in expired]
        for slot in slots:
            self.region.release(slot)
        return len(slots)
