"""Allocation of KV blocks to sequences, with reference counts and optional prefix caching."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from common.block_hash import chain_hash
from common.kv_events import BlockRemoved, BlockStored, KVEvent
from scheduler.sequence import Sequence, blocks_for


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None          # chained hash of a full block's tokens, None while partial
    token_ids: list[int] = field(default_factory=list)
    media: tuple[tuple[int, int, str], ...] = ()   # the image spans it holds (Sequence.block_media)


class BlockManager:
    """Hands out block ids; the caller checks (`can_*`) before it acts (`allocate`, `may_append`).

    With prefix caching, a full block is remembered by its chained hash after it is freed and
    reused, once its stored token ids are verified, by a later sequence with the same prefix.
    `on_event`, if set, is told each hash that joins or leaves the cache (common/kv_events.py).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.hash_to_block_id: dict[int, int] = {}
        self.on_event: Callable[[KVEvent], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def can_allocate(self, seq: Sequence) -> bool:
        # Conservative: cache hits would need fewer, but a check must never over-promise.
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Gives `seq` blocks for all its tokens, reusing cached full blocks of its prefix.

        Its own new blocks join the prefix cache only as their KV is computed (`commit`).
        """
        # The block holding the last token is always computed: its logits are needed.
        self._take_cached(seq, (len(seq) - 1) // self.block_size if seq.reads_prefix_cache else 0)
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block().block_id)

    def take_cached(self, seq: Sequence) -> int:
        """Gives `seq` the cached blocks of its prefix, every full block of its tokens included, and no other
        block (`may_append` adds the rest); returns how many it got."""
        self._take_cached(seq, len(seq) // self.block_size)
        return len(seq.block_table)

    def _take_cached(self, seq: Sequence, max_blocks: int) -> None:
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        prev_hash: int | None = None
        for i in range(max_blocks if self.enable_prefix_caching else 0):
            token_ids, media = seq.block(i), seq.block_media(i)
            h = chain_hash(token_ids, prev_hash, media)
            block_id = self._lookup(h, token_ids, media)
            if block_id is None:
                break
            seq.block_table.append(self._reuse_block(block_id).block_id)
            prev_hash = h
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_cached_tokens = seq.num_computed_tokens = len(seq.block_table) * self.block_size

    def allocate_fresh(self, seq: Sequence) -> None:
        """Gives `seq` unshared blocks for all its tokens that never join the prefix cache: a
        transfer writes them all."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        seq.block_table.extend(self._take_free_block().block_id for _ in range(seq.num_blocks))
        seq.num_hashed_blocks = seq.num_blocks   # their KV comes from elsewhere: never cached here

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s references; blocks nobody references go back to the free list."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = seq.num_computed_tokens = seq.num_hashed_blocks = 0

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= blocks_for(len(seq), self.block_size) - len(seq.block_table)

    def may_append(self, seq: Sequence) -> None:
        """Makes room for `seq`'s last token."""
        while len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block().block_id)

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Caches `seq`'s full blocks within its first `num_tokens` tokens, whose KV is in the
        pool by the end of this step (each layer writes a step's KV before any of it is read).

        Blocks are cached in order: one whose predecessor is not cached (KV pulled into blocks
        from `allocate_fresh`) never is.
        """
        if not self.enable_prefix_caching:
            return
        for index in range(seq.num_hashed_blocks, min(num_tokens, len(seq)) // self.block_size):
            prev = self.blocks[seq.block_table[index - 1]].hash if index > 0 else None
            if index > 0 and prev is None:
                return
            block = self.blocks[seq.block_table[index]]
            block.token_ids, block.media = seq.block(index), seq.block_media(index)
            block.hash = chain_hash(block.token_ids, prev, block.media)
            if self.on_event is not None and block.hash not in self.hash_to_block_id:
                extra = None if not block.media else ((tuple(d for _, _, d in block.media),),)
                self.on_event(BlockStored((block.hash,), prev, tuple(block.token_ids), self.block_size, extra))
            self.hash_to_block_id[block.hash] = block.block_id
            seq.num_hashed_blocks = index + 1

    def _lookup(self, h: int | None, token_ids: list[int], media: tuple[tuple[int, int, str], ...]) -> int | None:
        if h is None:
            return None
        block_id = self.hash_to_block_id.get(h)
        if block_id is None or self.blocks[block_id].token_ids != token_ids or self.blocks[block_id].media != media:
            return None
        return block_id

    def _take_free_block(self) -> Block:
        block = self.blocks[self.free_block_ids.popleft()]
        assert block.ref_count == 0, f"free block {block.block_id} is referenced"
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
            if self.on_event is not None:
                self.on_event(BlockRemoved((block.hash,)))
        block.hash, block.token_ids, block.media, block.ref_count = None, [], (), 1
        self.used_block_ids.add(block.block_id)
        return block

    def _reuse_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_block_ids.remove(block_id)
            self.used_block_ids.add(block_id)
        block.ref_count += 1
        return block
