"""The scheduling state of one request: its tokens, its block table and its status."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"  # blocks held while KV moves between prefill and decode
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Tokens so far (prompt then output) and where their KV lives.

    `num_cached_tokens` counts leading tokens whose KV was already in the pool when it got its
    blocks (prefix-cache hits); `num_computed_tokens` counts leading tokens whose KV is in the
    pool by the end of the step being scheduled, so the next step computes
    `token_ids[num_computed_tokens:]` (all of it, or a chunk of a long prompt). A running
    sequence that sampled its newest token has exactly that one token left to compute.
    """

    request_id: str
    token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False
    block_size: int = 16
    remote_kv: bool = False          # prefill: hold blocks until pulled; decode: pull the prompt's KV
    stop_token_ids: frozenset[int] = frozenset()   # tokens that end it as EOS does (even with ignore_eos)
    reads_prefix_cache: bool = True  # False: every prompt position is computed (its logits are wanted)
    kv_arriving: bool = False        # KV of its prefix is on its way into the prefix cache: it (and the queue) waits
    # Prompt positions whose input is an embedding, not a token: (start, length, digest) per image,
    # sorted and disjoint. The prefix cache keys blocks on them too.
    mm_spans: tuple[tuple[int, int, str], ...] = ()
    num_prompt_tokens: int = field(init=False)
    status: SequenceStatus = field(default=SequenceStatus.WAITING, init=False)
    block_table: list[int] = field(default_factory=list, init=False)
    num_cached_tokens: int = field(default=0, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_hashed_blocks: int = field(default=0, init=False)   # leading blocks the prefix cache has seen
    finish_reason: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV a step still has to compute: 1 for a decoding sequence."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_len(self) -> int:
        """The longest this sequence can grow: prompt plus every allowed output token."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def num_blocks(self) -> int:
        return blocks_for(len(self.token_ids), self.block_size)

    @property
    def num_cached_blocks(self) -> int:
        """Leading blocks that were prefix-cache hits when it got its blocks."""
        return self.num_cached_tokens // self.block_size

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def finished_generating(self) -> bool:
        """Nothing more to generate (its blocks may still be held for a transfer)."""
        return self.finish_reason is not None

    def block(self, index: int) -> list[int]:
        """Token ids of block `index` of this sequence (the last one may be partial)."""
        return self.token_ids[index * self.block_size:(index + 1) * self.block_size]

    def block_media(self, index: int) -> tuple[tuple[int, int, str], ...]:
        """The spans overlapping block `index`, their starts relative to the block's first position."""
        first = index * self.block_size
        return tuple((start - first, length, digest) for start, length, digest in self.mm_spans
                     if start < first + self.block_size and start + length > first)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size
