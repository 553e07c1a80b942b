"""Scheduler: continuous batching, preemption, refusal; driven with fake model outputs."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import QueueFull, Scheduler, SchedulerConfig, Sequence, SequenceStatus, WillNeverFit

EOS = 99


def make(num_blocks: int = 16, **kwargs) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, **kwargs), eos_token_ids=[EOS])


def seq(rid: str, n: int = 5, max_tokens: int = 4, first: int = 1) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), max_tokens=max_tokens, block_size=4)


def test_new_requests_prefill_between_decode_steps() -> None:
    s = make()
    s.add(seq("a"))
    batch, is_prefill = s.schedule()
    assert is_prefill and batch[0].request_id == "a" and batch[0].status is SequenceStatus.RUNNING
    s.postprocess(batch, [7])
    s.add(seq("b"))
    batch, is_prefill = s.schedule()
    assert is_prefill and [x.request_id for x in batch] == ["b"]
    s.postprocess(batch, [7])
    batch, is_prefill = s.schedule()
    assert not is_prefill and [x.request_id for x in batch] == ["a", "b"]


def test_finish_on_eos_and_length() -> None:
    s = make()
    a, b = seq("a", max_tokens=2), seq("b", max_tokens=2)
    b.ignore_eos = True
    for x in (a, b):
        s.add(x)
    batch, _ = s.schedule()
    s.postprocess(batch, [EOS, EOS])
    assert a.finish_reason == "stop" and not b.is_finished
    batch, _ = s.schedule()
    s.postprocess(batch, [5])
    assert b.finish_reason == "length" and s.is_finished()
    assert s.block_manager.num_free_blocks == 16


def test_refusals() -> None:
    s = make(num_blocks=2, max_waiting=1)
    with pytest.raises(WillNeverFit, match="needs 3 KV blocks"):
        s.add(seq("big", n=6, max_tokens=4))
    s.add(seq("a", n=2, max_tokens=2))
    with pytest.raises(QueueFull):
        s.add(seq("b", n=2, max_tokens=2))


def test_batch_limits() -> None:
    s = make(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=12)
    for i in range(4):
        s.add(seq(str(i), n=5))
    batch, _ = s.schedule()
    assert len(batch) == 2
    s2 = make(num_blocks=64, max_num_batched_tokens=12)
    for i in range(4):
        s2.add(seq(str(i), n=5, first=10 * i))  # distinct prompts: no prefix-cache hits
    assert len(s2.schedule()[0]) == 2  # 5 + 5 <= 12 < 15


@settings(max_examples=120, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 10)), min_size=1, max_size=12),
       num_blocks=st.integers(8, 20), max_num_seqs=st.integers(1, 6),
       aborts=st.sets(st.integers(0, 11)), abort_step=st.integers(0, 30))
def test_everything_completes_and_frees(lengths, num_blocks, max_num_seqs, aborts, abort_step) -> None:
    s = make(num_blocks=num_blocks, max_num_seqs=max_num_seqs)
    seqs = []
    for i, (n, m) in enumerate(lengths):
        x = seq(str(i), n=n, max_tokens=m)
        try:
            s.add(x)
            seqs.append(x)
        except WillNeverFit:
            assert (n + m + 3) // 4 > num_blocks
    for step in range(2000):
        if s.is_finished():
            break
        if step == abort_step:
            for x in seqs:
                if int(x.request_id) in aborts:
                    s.finish(x, "abort")
        batch, is_prefill = s.schedule()
        bm = s.block_manager
        assert len(bm.free_block_ids) + len(bm.used_block_ids) == num_blocks
        assert len(s.running) <= max_num_seqs
        tables = [b for x in s.running for b in x.block_table]
        if not bm.enable_prefix_caching:
            assert len(tables) == len(set(tables))
        for x in batch:
            assert len(x.block_table) == x.num_blocks
        s.postprocess(batch, [5] * len(batch))
    assert s.is_finished()
    assert s.block_manager.num_free_blocks == num_blocks and not s.block_manager.used_block_ids
    for x in seqs:
        assert x.finish_reason == ("abort" if x.finish_reason == "abort" else "length")
        if x.finish_reason == "length":
            assert x.num_output_tokens == x.max_tokens
