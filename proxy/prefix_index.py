"""An estimate of what a decode worker's prefix cache holds, kept by the proxy.

A decode worker caches the KV of a prompt's full blocks, keyed by a chained hash (each block's hash
folds in the one before it), whether it prefills the prompt itself or pulls the blocks from a prefill
worker (prefix-aware transfer). So the proxy records the prompts it sends to each decode worker, and
looks a new prompt's leading blocks up in that record. It is an estimate: the worker may have evicted blocks the index
still holds (under memory pressure, or after a restart), and the index forgets the least recently
used blocks beyond `capacity`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Sequence

from common.block_hash import chain_hash

DEFAULT_BLOCK_SIZE = 16  # the worker's --block-size default
DEFAULT_CAPACITY = 16384  # blocks remembered per decode worker (8 bytes of hash each, plus the dict's share)


class PrefixIndex:
    """The chained block hashes of prompts one decode worker prefilled, least recently used first."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, capacity: int = DEFAULT_CAPACITY) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be positive, got {block_size}, {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of the prompt the worker would find cached: whole blocks only, and never
        the block holding the last token (the worker computes that one for its logits)."""
        found = 0
        for h in self._block_hashes(token_ids, (len(token_ids) - 1) // self.block_size):
            if h not in self._hashes:
                break
            self._hashes.move_to_end(h)
            found += 1
        return found * self.block_size

    def add(self, token_ids: Sequence[int]) -> None:
        """Records that the worker prefilled this prompt: its full blocks are cached there now."""
        for h in self._block_hashes(token_ids, len(token_ids) // self.block_size):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def _block_hashes(self, token_ids: Sequence[int], num_blocks: int) -> Iterator[int]:
        """The chained hashes of the first `num_blocks` blocks, computed as they are asked for."""
        prev: int | None = None
        for i in range(num_blocks):
            prev = chain_hash(list(token_ids[i * self.block_size:(i + 1) * self.block_size]), prev)
            yield prev
