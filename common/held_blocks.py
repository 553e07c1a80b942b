"""Prefill: the KV block sets held for a decode peer's pull, and since when (what an operator watches: a set
held past the abort timeout means blocks are leaking). Our worker and NeuronConnector inside `vllm serve`
export them as the same gauges, `BLOCKS_HELD`, `HELD_OLDEST` and `ABORT_TIMEOUT` (one alert, one panel)."""
from __future__ import annotations

import threading
import time

BLOCKS_HELD = ("neuron_di_kv_blocks_held", "Prefill: KV blocks held for a decode peer's pull")
HELD_OLDEST = ("neuron_di_kv_held_oldest_seconds",
               "Prefill: how long the oldest block set held for a pull has waited (0 when none is)")
ABORT_TIMEOUT = ("neuron_di_kv_abort_timeout_seconds",
                 "Prefill: the abort timeout, after which blocks nobody pulled are freed")


class HeldBlocks:
    """Request id -> (blocks, held since); thread-safe (published on the engine's thread, released on the
    signal plane's)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def hold(self, request_id: str, num_blocks: int) -> bool:
        """Holds `num_blocks` for `request_id` from now; False (the first hold kept) if it is held already."""
        with self._lock:
            if request_id in self._held:
                return False
            self._held[request_id] = (num_blocks, time.monotonic())
            return True

    def release(self, request_id: str) -> None:
        with self._lock:
            self._held.pop(request_id, None)

    def __len__(self) -> int:
        """How many block sets are held."""
        return len(self._held)

    def snapshot(self) -> tuple[int, float]:
        """The blocks held now, and how long the oldest set has been held (0 when none is)."""
        now = time.monotonic()
        with self._lock:
            held = list(self._held.values())
        return sum(n for n, _ in held), max((now - since for _, since in held), default=0.0)
