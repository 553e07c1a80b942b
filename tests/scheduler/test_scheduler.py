"""Scheduler: continuous batching, preemption, refusal; driven with fake model outputs."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import QueueFull, ScheduledStep, Scheduler, SchedulerConfig, Sequence, SequenceStatus, WillNeverFit
from tests.scheduler.steps import prefills

EOS = 99


def make(num_blocks: int = 16, **kwargs) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, **kwargs), eos_token_ids=[EOS])


def seq(rid: str, n: int = 5, max_tokens: int = 4, first: int = 1) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), max_tokens=max_tokens, block_size=4)


def test_new_requests_prefill_between_decode_steps() -> None:
    s = make()
    s.add(seq("a"))
    step = s.schedule()
    batch, is_prefill = step.seqs, prefills(step)
    assert is_prefill and batch[0].request_id == "a" and batch[0].status is SequenceStatus.RUNNING
    s.postprocess(batch, [7])
    s.add(seq("b"))
    step = s.schedule()
    batch, is_prefill = step.seqs, prefills(step)
    assert is_prefill and [x.request_id for x in batch] == ["b"]
    s.postprocess(batch, [7])
    step = s.schedule()
    batch, is_prefill = step.seqs, prefills(step)
    assert not is_prefill and [x.request_id for x in batch] == ["a", "b"]


def test_chunked_prefill_runs_decodes_first_and_the_prompt_in_chunks() -> None:
    s = make(num_blocks=32, max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=8)
    s.add(seq("a", n=3, max_tokens=10))
    s.postprocess(s.schedule().sampled, [7])
    s.add(seq("b", n=20, max_tokens=2, first=50))
    shapes = []
    for _ in range(3):
        step = s.schedule()
        shapes.append([(c.seq.request_id, c.start, c.num_tokens, c.samples) for c in step.chunks])
        s.postprocess(step.sampled, [7] * len(step.sampled))
    assert shapes == [[("a", 3, 1, True), ("b", 0, 7, False)],
                      [("a", 4, 1, True), ("b", 7, 7, False)],
                      [("a", 5, 1, True), ("b", 14, 6, True)]]


def shapes_of(s: Scheduler, steps: int) -> list[list[tuple[str, int, int]]]:
    """(request, start, tokens) of each chunk of the next `steps` steps, every sampled token 7."""
    shapes = []
    for _ in range(steps):
        step = s.schedule()
        shapes.append([(c.seq.request_id, c.start, c.num_tokens) for c in step.chunks])
        s.postprocess(step.sampled, [7] * len(step.sampled))
    return shapes


def test_short_prompts_run_alone_until_the_streams_waited_decode_pause_tokens() -> None:
    s = make(num_blocks=64, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=8,
             short_prompt_tokens=8, decode_pause_tokens=16)
    s.add(seq("a", max_tokens=10))
    assert shapes_of(s, 1) == [[("a", 0, 5)]]
    for i, rid in enumerate("bcde"):
        s.add(seq(rid, max_tokens=10, first=10 * (i + 1)))
    assert shapes_of(s, 4) == [[("b", 0, 5), ("c", 0, 3)],                # a waits: 8 prompt tokens
                               [("e", 0, 1), ("c", 3, 2), ("d", 0, 5)],   # 16: a decode step is due
                               [("a", 5, 1), ("b", 5, 1), ("c", 5, 1), ("d", 5, 1), ("e", 1, 4)],
                               [("a", 6, 1), ("b", 6, 1), ("c", 6, 1), ("d", 6, 1), ("e", 5, 1)]]


def test_long_prompts_share_steps_with_decodes() -> None:
    s = make(num_blocks=64, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=8,
             short_prompt_tokens=11, decode_pause_tokens=64)
    s.add(seq("a", max_tokens=10))
    s.add(seq("long", n=12, max_tokens=2, first=50))
    assert shapes_of(s, 3) == [[("a", 0, 5), ("long", 0, 3)],     # nothing decodes yet: one step takes both
                               [("a", 5, 1), ("long", 3, 7)],     # 12 tokens are not short
                               [("a", 6, 1), ("long", 10, 2)]]    # nor is its rest


def test_prompts_that_fit_beside_the_decodes_share_their_step() -> None:
    s = make(num_blocks=64, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=8,
             short_prompt_tokens=6, decode_pause_tokens=64)
    s.add(seq("a", n=3, max_tokens=20))
    assert shapes_of(s, 1) == [[("a", 0, 3)]]
    s.add(seq("b", n=4, max_tokens=20, first=30))
    s.add(seq("c", n=3, max_tokens=20, first=40))
    assert shapes_of(s, 1) == [[("a", 3, 1), ("b", 0, 4), ("c", 0, 3)]]   # one gap either way, one step fewer


def test_each_wave_gets_a_whole_pause() -> None:
    s = make(num_blocks=64, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=8,
             short_prompt_tokens=6, decode_pause_tokens=20)
    s.add(seq("a", n=3, max_tokens=20))
    assert shapes_of(s, 1) == [[("a", 0, 3)]]
    for i, rid in enumerate("bcd"):
        s.add(seq(rid, max_tokens=20, first=10 * (i + 1)))
    assert shapes_of(s, 3) == [[("b", 0, 5), ("c", 0, 3)], [("c", 3, 2), ("d", 0, 5)],   # the wave, 15 tokens
                               [("a", 3, 1), ("b", 5, 1), ("c", 5, 1), ("d", 5, 1)]]
    for i, rid in enumerate("efg"):
        s.add(seq(rid, max_tokens=20, first=50 + 10 * i))
    # The decode step ended the first pause: the next wave's starts from 0, not from the first wave's 15.
    assert shapes_of(s, 3) == [[("e", 0, 5), ("f", 0, 3)], [("f", 3, 2), ("g", 0, 5)],
                               [(rid, n, 1) for rid, n in zip("abcdefg", [4, 6, 6, 6, 5, 5, 5])]]


@pytest.mark.parametrize("short, pause", [(-1, 8), (8, 0)])
def test_short_prompt_and_pause_tokens_are_checked(short: int, pause: int) -> None:
    with pytest.raises(ValueError, match=f"got {short} and {pause}"):
        SchedulerConfig(num_blocks=4, block_size=4, short_prompt_tokens=short, decode_pause_tokens=pause)


def test_finish_on_eos_and_length() -> None:
    s = make()
    a, b = seq("a", max_tokens=2), seq("b", max_tokens=2)
    b.ignore_eos = True
    for x in (a, b):
        s.add(x)
    batch = s.schedule().seqs
    s.postprocess(batch, [EOS, EOS])
    assert a.finish_reason == "stop" and not b.is_finished
    batch = s.schedule().seqs
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
    batch = s.schedule().seqs
    assert len(batch) == 2
    s2 = make(num_blocks=64, max_num_batched_tokens=12)
    for i in range(4):
        s2.add(seq(str(i), n=5, first=10 * i))  # distinct prompts: no prefix-cache hits
    assert len(s2.schedule().seqs) == 2  # 5 + 5 <= 12 < 15


@settings(max_examples=120, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 10)), min_size=1, max_size=12),
       num_blocks=st.integers(8, 20), max_num_seqs=st.integers(1, 6),
       aborts=st.sets(st.integers(0, 11)), abort_step=st.integers(0, 30), caching=st.booleans(),
       shared_prefix=st.booleans(), chunk_budget=st.one_of(st.none(), st.integers(6, 14)),
       short=st.integers(0, 12), pause=st.integers(1, 20))
def test_everything_completes_and_frees(lengths, num_blocks, max_num_seqs, aborts, abort_step, caching,
                                        shared_prefix, chunk_budget, short, pause) -> None:
    chunking = {} if chunk_budget is None else {"enable_chunked_prefill": True, "max_num_batched_tokens": chunk_budget,
                                                "short_prompt_tokens": short, "decode_pause_tokens": pause}
    s = make(num_blocks=num_blocks, max_num_seqs=max_num_seqs, enable_prefix_caching=caching, **chunking)
    seqs = []
    for i, (n, m) in enumerate(lengths):
        x = seq(str(i), n=n, max_tokens=m, first=1 if shared_prefix else 100 * i)
        try:
            s.add(x)
            seqs.append(x)
        except WillNeverFit:
            assert (n + m + 3) // 4 > num_blocks
    waited = 0
    for step in range(2000):
        if s.is_finished():
            break
        if step == abort_step:
            for x in seqs:
                if int(x.request_id) in aborts:
                    s.finish(x, "abort")
        decoding = [x for x in s.running if x.num_uncomputed_tokens == 1]
        computed = {x.request_id: x.num_computed_tokens for x in s.running}
        step = s.schedule()
        batch = step.seqs
        waited = check_chunks(s, step, decoding, computed, waited)
        bm = s.block_manager
        assert len(bm.free_block_ids) + len(bm.used_block_ids) == num_blocks
        assert len(s.running) <= max_num_seqs
        refs: dict[int, int] = {}
        for x in s.running:
            for b in x.block_table:
                refs[b] = refs.get(b, 0) + 1
        assert refs == {b.block_id: b.ref_count for b in bm.blocks if b.ref_count}
        assert set(refs) == bm.used_block_ids
        if not caching:
            assert all(count == 1 for count in refs.values())  # never shared, so never doubly given
        for x in batch:
            assert len(x.block_table) == x.num_blocks
        s.postprocess(step.sampled, [5] * len(step.sampled))
    assert s.is_finished()
    assert s.block_manager.num_free_blocks == num_blocks and not s.block_manager.used_block_ids
    for x in seqs:
        assert x.finish_reason == ("abort" if x.finish_reason == "abort" else "length")
        if x.finish_reason == "length":
            assert x.num_output_tokens == x.max_tokens


def check_chunks(s: Scheduler, step: ScheduledStep, decoding: list[Sequence], computed: dict[str, int],
                 waited: int) -> int:
    """Chunks continue where the last step stopped, sample only at a sequence's end, and (chunked) stay within
    the budget with every decode that was not preempted scheduled ahead of prompt chunks, or none while the
    streams have waited (`waited`: prompt tokens run ahead of them so far) less than the pause. Returns how
    long the streams have waited after this step."""
    sizes = [c.num_tokens for c in step.chunks]
    assert sizes == sorted(sizes, key=lambda n: n > 1) and min(sizes, default=1) >= 1
    for c in step.chunks:
        assert c.start == computed.get(c.seq.request_id, c.seq.num_cached_tokens)
        assert c.seq.num_computed_tokens == c.start + c.num_tokens <= len(c.seq)
        assert c.samples == (c.start + c.num_tokens == len(c.seq))
    if s.config.enable_chunked_prefill:
        assert step.num_tokens <= s.config.max_num_batched_tokens
        scheduled = {id(x) for x in step.seqs}
        running = [x for x in decoding if x.status is SequenceStatus.RUNNING]
        if all(id(x) in scheduled for x in running):
            return 0
        # Or none: short prompts alone ahead of them, for fewer than the pause's tokens before this step.
        assert s.config.short_prompt_tokens and not any(id(x) in scheduled for x in running)
        assert all(len(c.seq) <= s.config.short_prompt_tokens for c in step.chunks)
        assert waited < s.config.decode_pause_tokens
        return waited + step.num_tokens
    assert all(c.samples for c in step.chunks)   # unchunked: whole prompts, whole decodes
    return 0
