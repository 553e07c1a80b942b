"""Continuous batching, transfer-aware for the disaggregated roles.

Role "both": new requests prefill while others decode. With chunked prefill (`enable_chunked_
prefill`) a step holds at most `max_num_batched_tokens` tokens: every decode first, then the rest
of the budget to prompt chunks, oldest first, so a long prompt never stalls running streams
for its whole prefill. Mixed steps stall running streams once per short prompt of a wave: with
`short_prompt_tokens` (S > 0) prompts of at most S tokens run in steps of their own,
ahead of the decodes, until the running streams have waited for `decode_pause_tokens` prompt
tokens, and a wave of them costs the streams one gap instead of one per prompt (a pause starts
only while something decodes and the prompts need more than one step beside the decodes); longer
prompts still share steps with the decodes. Without chunked prefill a step is either whole prompts or one
decode of every running request. Role "prefill": one prefill runs at a time, and a request whose KV a decode peer will pull (`remote_kv`) stays TRANSFERRING with
its blocks held after it finished, until `release`. Role "decode": a `remote_kv` request
gets its blocks and waits TRANSFERRING (`admit_transfers`) until the engine reports the
pull done (`transfer_done`, its first token) or failed (`release`). With
`prefix_aware_transfer` its leading blocks come from the prefix cache where it has them
(`Sequence.num_cached_blocks`), only the rest is pulled, and the pulled full blocks join the
cache once they arrived. Running + transferring never exceeds `max_num_seqs`, but on a prefill worker,
whose held requests cost only their blocks: were they to take batch slots, a decode peer's pulls could
wait on prefills queued behind KV held for requests that decode peer has no slot for yet, each side's
slots full of the other's missing half until a timeout.
A waiting request whose prefix's KV is on its way into the prefix cache (`kv_arriving`, set by
the engine) is not started, nor is any request behind it, until the flag is cleared.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from common.roles import ROLES
from scheduler.block_manager import BlockManager
from scheduler.errors import QueueFull, WillNeverFit
from scheduler.sequence import Sequence, SequenceStatus, blocks_for


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    max_waiting: int = 256
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = False
    role: str = "both"
    prefix_aware_transfer: bool = True   # decode: pull only the blocks the prefix cache lacks
    short_prompt_tokens: int = 0      # chunked: prompts this long or shorter run ahead of decodes (0: none)
    decode_pause_tokens: int = 4096   # ... for at most this many prompt tokens before a decode step

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"with chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be at least max_num_seqs ({self.max_num_seqs}): every step decodes "
                             f"every running request")
        if self.short_prompt_tokens < 0 or self.decode_pause_tokens < 1:
            raise ValueError(f"short_prompt_tokens must be >= 0 and decode_pause_tokens >= 1, got "
                             f"{self.short_prompt_tokens} and {self.decode_pause_tokens}")


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq` from position `start`; its last one is sampled if it ends `seq`."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens == len(self.seq)


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """What one step computes: one-token chunks (decodes) first, then longer chunks."""

    chunks: list[ScheduledChunk]

    def __bool__(self) -> bool:
        return bool(self.chunks)

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.chunks]

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a new token this step, in chunk order."""
        return [c.seq for c in self.chunks if c.samples]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Decides what runs each step; knows nothing of tensors.

    A step is either one prefill batch (waiting requests that fit) or one decode step of every
    running request. When a decode step runs out of blocks the newest running request is
    preempted: its blocks are freed and it waits to be recomputed from its tokens so far.
    """

    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.transferring: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._paused_tokens = 0   # short prompts' tokens run while streams wait for their next token

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.transferring)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.transferring

    def has_runnable(self) -> bool:
        """Whether schedule() could return work now (transfers alone only need polling)."""
        first = next((s for s in self.waiting if not self._needs_pull(s)), None)
        return bool(self.running) or (first is not None and not first.kv_arriving)

    def _num_busy(self) -> int:
        """The batch slots taken (a prefill worker's held requests take none: see the module docstring)."""
        return len(self.running) + (len(self.transferring) if self.config.role != "prefill" else 0)

    def _needs_pull(self, seq: Sequence) -> bool:
        return self.config.role == "decode" and seq.remote_kv

    def check_admissible(self, seq: Sequence) -> None:
        """Raises unless `seq` can ever complete in an empty pool and the queue has room."""
        needed = blocks_for(seq.max_len, self.config.block_size)
        if needed > self.config.num_blocks:
            raise WillNeverFit(f"request {seq.request_id!r} needs {needed} KV blocks at its full length "
                               f"({seq.max_len} tokens) but the pool has only {self.config.num_blocks}")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.config.max_waiting} requests)")

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        """The chunks to compute this step (see the module docstring for the policy)."""
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill:
            chunks = self._schedule_waiting(budget) or self._schedule_running(None)
        elif not (chunks := self._schedule_short_prompts_alone(budget)):
            preemptions = self.num_preemptions
            chunks = self._schedule_running(budget)
            if self.num_preemptions == preemptions:   # blocks ran short: admit nothing new this step
                chunks += self._schedule_waiting(budget - sum(c.num_tokens for c in chunks))
        chunks.sort(key=lambda c: c.num_tokens > 1)   # stable: decodes first, as the runner wants them
        return ScheduledStep(chunks)

    @staticmethod
    def _decodes(seq: Sequence) -> bool:
        return seq.num_uncomputed_tokens == 1

    def _schedule_short_prompts_alone(self, budget: int) -> list[ScheduledChunk]:
        """A step of short prompts alone, running ones first, while the running streams have waited for fewer
        than `decode_pause_tokens` prompt tokens; [] when a normal step is due, which decodes the streams and
        so ends the pause: the policy is off, nothing decodes (a normal step batches every prompt), the pause
        is over, one step takes every prompt under way or waiting beside the decodes (a pause would not
        shorten the streams' gap, only add a step), or no short prompt is left."""
        limit, paused = self.config.short_prompt_tokens, self._paused_tokens
        decodes = sum(map(self._decodes, self.running))
        chunks: list[ScheduledChunk] = []
        if (limit and decodes and paused < self.config.decode_pause_tokens
                and not self._prompts_fit(budget - decodes)):
            def short(seq: Sequence) -> bool:   # a whole prompt, not a long one's last chunk
                return len(seq) <= limit and not self._decodes(seq)

            chunks = self._schedule_running(budget, short)
            chunks += self._schedule_waiting(budget - sum(c.num_tokens for c in chunks), short)
        self._paused_tokens = paused + sum(c.num_tokens for c in chunks) if chunks else 0
        return chunks

    def _prompts_fit(self, room: int) -> bool:
        """Whether every prompt under way or waiting fits in `room` tokens, what a step leaves beside the decodes
        (a waiting one counted whole, as if none of it were cached)."""
        tokens = sum(s.num_uncomputed_tokens for s in self.running if not self._decodes(s))
        tokens += sum(len(s) for s in self.waiting if not self._needs_pull(s))
        return tokens <= room

    def _schedule_waiting(self, budget: int,
                          which: Callable[[Sequence], bool] = lambda s: True) -> list[ScheduledChunk]:
        """New (or preempted) requests that get blocks now and their first chunk, oldest first, up to
        the first that is not `which`."""
        chunks: list[ScheduledChunk] = []
        if self.config.role == "prefill" and self.running:
            return chunks  # one prefill at a time: it starts only when nothing runs
        chunked = self.config.enable_chunked_prefill
        for seq in [s for s in self.waiting if not self._needs_pull(s)]:
            if budget <= 0 or self._num_busy() >= self.config.max_num_seqs or seq.kv_arriving or not which(seq):
                break
            # Unchunked, a lone request may exceed the token budget: prompts are not split.
            too_many = not chunked and chunks and len(seq) > budget
            if too_many or not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.waiting.remove(seq)
            self.running.append(seq)
            chunks.append(self._chunk(seq, budget if chunked else seq.num_uncomputed_tokens))
            budget -= chunks[-1].num_tokens
            if self.config.role == "prefill":
                break
        return chunks

    def _schedule_running(self, budget: int | None,
                          which: Callable[[Sequence], bool] = lambda s: True) -> list[ScheduledChunk]:
        """Running requests (`which` of them), decodes first, within `budget` tokens (None: no limit).
        A decode that finds no free block preempts the newest request not yet scheduled (or itself)."""
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        for seq in sorted(filter(which, self.running), key=lambda s: s.num_uncomputed_tokens > 1):
            if seq.status is not SequenceStatus.RUNNING or (budget is not None and budget <= 0):
                continue   # preempted by an earlier one, or no budget left
            while not self.block_manager.can_append(seq):
                victims = [s for s in self.running if s is not seq and s.request_id not in scheduled]
                self._preempt(victims[-1] if victims else seq)
                if not victims:
                    break
            else:
                self.block_manager.may_append(seq)
                chunks.append(self._chunk(seq, budget if budget is not None else seq.num_uncomputed_tokens))
                scheduled.add(seq.request_id)
                if budget is not None:
                    budget -= chunks[-1].num_tokens
        return chunks

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledChunk:
        """The next chunk of `seq` (at most `budget` tokens); its KV counts as computed from now on."""
        chunk = ScheduledChunk(seq, seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget))
        seq.num_computed_tokens += chunk.num_tokens
        self.block_manager.commit(seq, seq.num_computed_tokens)
        return chunk

    def admit_transfers(self) -> list[Sequence]:
        """Decode: gives waiting `remote_kv` requests blocks and marks them TRANSFERRING.

        The caller starts a pull into each returned sequence's `block_table` past its first
        `num_cached_blocks` (cached blocks, with prefix-aware transfer; else none).
        """
        admitted: list[Sequence] = []
        for seq in [s for s in self.waiting if self._needs_pull(s)]:
            if not self._can_admit(seq):
                break
            if self.config.prefix_aware_transfer:
                self.block_manager.allocate(seq)
            else:
                self.block_manager.allocate_fresh(seq)
            seq.status = SequenceStatus.TRANSFERRING
            self.waiting.remove(seq)
            self.transferring[seq.request_id] = seq
            admitted.append(seq)
        return admitted

    def can_admit_transfer(self) -> bool:
        """Decode: whether admit_transfers() would admit a request now (they are admitted in order)."""
        first = next((s for s in self.waiting if self._needs_pull(s)), None)
        return first is not None and self._can_admit(first)

    def _can_admit(self, seq: Sequence) -> bool:
        return self._num_busy() < self.config.max_num_seqs and self.block_manager.can_allocate(seq)

    def transfer_done(self, seq: Sequence, token_id: int | None) -> None:
        """Decode: the prompt's KV arrived with the peer's first token; `seq` runs from here. None: a moved
        stream's KV arrived, of every token it has but the newest, which the next step computes."""
        assert self.transferring.get(seq.request_id) is seq, f"{seq.request_id} is not transferring"
        del self.transferring[seq.request_id]
        seq.remote_kv = False  # from here on it is local: a preemption recomputes it
        computed = len(seq) if token_id is not None else len(seq) - 1
        seq.num_computed_tokens = computed   # the pulled KV is in its blocks: only new tokens run here
        self.block_manager.commit(seq, computed)   # pulled full blocks: a later prompt with this prefix reuses them
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if token_id is not None:
            self.postprocess([seq], [token_id])

    def hold(self, seq: Sequence) -> None:
        """Decode: a running sequence stops, its blocks held TRANSFERRING for another worker's pull (`release`
        frees them)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.TRANSFERRING
        self.transferring[seq.request_id] = seq

    def release(self, seq: Sequence, reason: str | None = None) -> None:
        """Frees a TRANSFERRING sequence's blocks (pulled, failed or abandoned); it is FINISHED."""
        assert self.transferring.get(seq.request_id) is seq, f"{seq.request_id} is not transferring"
        del self.transferring[seq.request_id]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Appends each sampled token; finishes sequences on EOS, a stop token or max_tokens."""
        for seq, token_id in zip(seqs, token_ids):
            seq.token_ids.append(token_id)
            if (not seq.ignore_eos and token_id in self.eos_token_ids) or token_id in seq.stop_token_ids:
                self.finish(seq, "stop")
            elif seq.num_output_tokens >= seq.max_tokens:
                self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends `seq` (EOS, length, a stop string or an abort) and frees its blocks at once.

        On a prefill worker a `remote_kv` request that completed keeps its blocks, TRANSFERRING.
        """
        if seq.is_finished:
            return
        if seq.request_id in self.transferring:
            seq.finish_reason = seq.finish_reason or reason
            if reason == "abort":
                self.release(seq)
            return
        if self.config.role == "prefill" and seq.remote_kv and reason != "abort" and seq in self.running:
            self.running.remove(seq)
            seq.status = SequenceStatus.TRANSFERRING
            seq.finish_reason = reason
            self.transferring[seq.request_id] = seq
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
