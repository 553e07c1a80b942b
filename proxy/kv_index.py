"""What each worker's prefix cache holds, as its KV cache events tell the proxy (common/kv_events.py).

Every worker's events name blocks by the engine's own hashes, which differ between engines (vLLM's
sha256, ours), so each stored block is re-keyed by the proxy's own chained hash of its token ids
(common/block_hash.py): a prompt's blocks then match on every worker alike. A worker's index maps
engine hash -> own hash (to chain a parent and to apply a removal) and own hash -> engine hash, least
recently used first, and forgets the oldest beyond `capacity`. Missed events cannot be repaired: a
gap in the sequence numbers or a restart drops the worker's index and it fills again from the next
events. Sans-I/O: batches in, lookups out.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from common.block_hash import chain_hash
from common.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch

DEFAULT_CAPACITY = 1_000_000   # blocks remembered per worker


class WorkerKVIndex:
    """One worker's cached blocks, keyed by the proxy's chained hash."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.block_size = 0            # the worker's, from its first BlockStored (0: not known yet)
        self.next_seq: int | None = None
        self._own: dict[BlockHash, int] = {}
        self._held: OrderedDict[int, BlockHash] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._own.clear()
        self._held.clear()

    def apply(self, batch: EventBatch) -> str | None:
        """Applies one batch; why the index was dropped first (a sequence gap, a restart), or None."""
        dropped = None
        if self.next_seq is not None and batch.seq != self.next_seq:
            dropped = (f"sequence gap: batch {batch.seq} after {self.next_seq - 1}" if batch.seq > self.next_seq
                       else f"sequence went back to {batch.seq} (the worker restarted)")
            self.clear()
        self.next_seq = batch.seq + 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
        return dropped

    def matched_blocks(self, own_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its own chained hashes) this worker holds."""
        found = 0
        for h in own_hashes:
            if h not in self._held:
                break
            self._held.move_to_end(h)
            found += 1
        return found

    def _stored(self, event: BlockStored) -> None:
        size = self.block_size = event.block_size
        parent = None if event.parent_block_hash is None else self._own.get(event.parent_block_hash)
        if event.parent_block_hash is not None and parent is None:
            return   # its prefix is not known (dropped, or forgotten): it cannot be chained
        for i, engine_hash in enumerate(event.block_hashes):
            extra = event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None
            media = () if extra is None else ((0, 0, repr(extra)),)
            parent = chain_hash(list(event.token_ids[i * size:(i + 1) * size]), parent, media)
            self._own[engine_hash] = parent
            self._held[parent] = engine_hash
            self._held.move_to_end(parent)
        while len(self._held) > self.capacity:
            _, engine_hash = self._held.popitem(last=False)
            self._own.pop(engine_hash, None)

    def _removed(self, engine_hashes: Iterable[BlockHash]) -> None:
        for engine_hash in engine_hashes:
            own = self._own.pop(engine_hash, None)
            if own is not None and self._held.get(own) == engine_hash:
                del self._held[own]


def prompt_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[int]:
    """The proxy's chained hashes of a prompt's first `num_blocks` full blocks (default: all of them)."""
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    out: list[int] = []
    prev: int | None = None
    for i in range(n):
        prev = chain_hash(list(token_ids[i * block_size:(i + 1) * block_size]), prev)
        out.append(prev)
    return out


class KVIndexes:
    """Every followed worker's index, by worker key, and prompt lookups across them."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._by_worker: dict[str, WorkerKVIndex] = {}

    def index(self, key: str) -> WorkerKVIndex:
        index = self._by_worker.get(key)
        if index is None:
            index = self._by_worker[key] = WorkerKVIndex(self.capacity)
        return index

    def drop(self, key: str) -> None:
        self._by_worker.pop(key, None)

    def clear(self, key: str) -> None:
        """The worker's cache is gone (it died or restarted): its index starts empty."""
        if key in self._by_worker:
            self._by_worker[key].clear()

    def overlaps(self, token_ids: Sequence[int], keys: Sequence[str], last_block_computed: bool = True) -> list[int]:
        """Per worker of `keys`, the prompt's leading tokens it holds, in whole blocks; with
        `last_block_computed`, never the block holding the last token (a worker computes it for its logits)."""
        hashes: dict[int, list[int]] = {}
        out = []
        for key in keys:
            index = self._by_worker.get(key)
            if index is None or not index.block_size:
                out.append(0)
                continue
            size = index.block_size
            if size not in hashes:
                n = (len(token_ids) - 1) // size if last_block_computed else len(token_ids) // size
                hashes[size] = prompt_hashes(token_ids, size, max(n, 0))
            out.append(index.matched_blocks(hashes[size]) * size)
        return out
