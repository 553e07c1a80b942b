"""Transfer-aware rules of roles prefill and decode, and their invariants over random event sequences."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Scheduler, SchedulerConfig, Sequence, SequenceStatus
from tests.scheduler.steps import prefills

BLOCK = 4


def scheduler(role: str, num_blocks: int = 32, max_num_seqs: int = 3, prefix_aware: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_num_seqs,
                                     role=role, prefix_aware_transfer=prefix_aware), eos_token_ids=[0])


def seq(i: int, prompt_len: int = 5, max_tokens: int = 1, remote: bool = True) -> Sequence:
    return Sequence(f"r{i}", list(range(1, prompt_len + 1)), max_tokens, block_size=BLOCK, remote_kv=remote)


def test_prefill_runs_one_prefill_at_a_time_and_holds_finished_blocks() -> None:
    s = scheduler("prefill")
    for i in range(3):
        s.add(seq(i))
    step = s.schedule()
    seqs, is_prefill = step.seqs, prefills(step)
    assert is_prefill and [x.request_id for x in seqs] == ["r0"]
    s.postprocess(seqs, [7])
    assert seqs[0].status is SequenceStatus.TRANSFERRING and seqs[0].finish_reason == "length"
    assert s.block_manager.num_free_blocks == 32 - 2
    s.release(seqs[0])
    assert seqs[0].is_finished and s.block_manager.num_free_blocks == 32


def test_a_prompt_whose_prefix_kv_is_arriving_waits_with_the_queue_behind_it() -> None:
    s = scheduler("prefill")
    first, second = seq(0), seq(1)
    s.add(first)
    s.add(second)
    first.kv_arriving = True
    assert not s.has_runnable() and not s.schedule()
    first.kv_arriving = False
    assert s.has_runnable() and s.schedule().seqs == [first]


def test_prefill_holds_finished_requests_past_the_batch_size_and_waits_only_for_blocks() -> None:
    s = scheduler("prefill", num_blocks=6, max_num_seqs=2)  # a 5-token prompt takes 2 blocks
    for i in range(4):
        s.add(Sequence(f"r{i}", [10 * i + j for j in range(1, 6)], 1, block_size=BLOCK, remote_kv=True))
    for _ in range(3):
        seqs = s.schedule().seqs
        s.postprocess(seqs, [7])
    assert sorted(s.transferring) == ["r0", "r1", "r2"] and not s.running   # past max_num_seqs 2
    assert not s.schedule()   # r3 waits for blocks
    s.release(s.transferring["r0"])
    assert [x.request_id for x in s.schedule().seqs] == ["r3"]


def test_decode_runs_a_request_only_after_its_transfer() -> None:
    s = scheduler("decode")
    s.add(seq(0, max_tokens=3))
    assert not s.has_runnable() and not s.schedule()
    (pulled,) = s.admit_transfers()
    assert pulled.status is SequenceStatus.TRANSFERRING and len(pulled.block_table) == 2
    assert not s.schedule()
    s.transfer_done(pulled, 9)
    assert pulled.output_token_ids == [9] and pulled.status is SequenceStatus.RUNNING
    step = s.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in step.chunks] == [(pulled, 5, 1)]  # a decode, no prompt recompute


def test_without_prefix_aware_transfer_decode_pulls_into_fresh_blocks_never_cached_ones() -> None:
    s = scheduler("decode", prefix_aware=False)
    local = Sequence("local", list(range(1, 9)), 1, block_size=BLOCK)
    s.add(local)
    seqs = s.schedule().seqs
    s.postprocess(seqs, [5])  # finished: its full blocks stay in the prefix cache
    cached = dict(s.block_manager.hash_to_block_id)
    s.add(seq(1, prompt_len=8))
    (pulled,) = s.admit_transfers()
    assert pulled.num_cached_tokens == 0
    assert all(s.block_manager.blocks[b].ref_count == 1 for b in pulled.block_table)
    s.transfer_done(pulled, 9)
    assert s.block_manager.hash_to_block_id == cached   # the pulled blocks never join the cache


EVENTS = st.lists(st.tuples(st.sampled_from(["add", "step", "done", "fail", "release", "abort"]),
                            st.integers(0, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(role=st.sampled_from(["prefill", "decode", "both"]), events=EVENTS, prefix_aware=st.booleans())
def test_invariants_hold_over_random_events(role: str, events: list[tuple[str, int]], prefix_aware: bool) -> None:
    s = scheduler(role, num_blocks=12, max_num_seqs=3, prefix_aware=prefix_aware)
    live: list[Sequence] = []
    for n, (event, arg) in enumerate(events):
        if event == "add":
            candidate = seq(n, prompt_len=1 + arg % 9, max_tokens=1 + arg % 3, remote=role != "both")
            if s.config.num_blocks * BLOCK >= candidate.max_len:
                s.add(candidate)
                live.append(candidate)
        elif event == "step":
            s.admit_transfers()
            step = s.schedule()
            seqs, is_prefill = step.seqs, prefills(step)
            assert not (role == "prefill" and is_prefill and len(seqs) > 1)  # one prefill at a time
            s.postprocess(seqs, [1 + arg] * len(seqs))
        elif s.transferring:
            target = list(s.transferring.values())[arg % len(s.transferring)]
            if event == "done" and role == "decode" and not target.finished_generating:
                s.transfer_done(target, 1 + arg)
            elif event in ("fail", "release"):
                s.release(target, "error")
            elif event == "abort":
                s.finish(target, "abort")
        check(s, live)
    for target in list(s.transferring.values()):
        s.release(target)
    for target in list(s.running) + list(s.waiting):
        s.finish(target, "abort")
    assert s.block_manager.num_free_blocks == s.config.num_blocks


def check(s: Scheduler, live: list[Sequence]) -> None:
    busy = len(s.running) + (len(s.transferring) if s.config.role != "prefill" else 0)
    assert busy <= s.config.max_num_seqs
    held = {b for x in live for b in x.block_table}
    assert held == s.block_manager.used_block_ids
    assert len(s.block_manager.free_block_ids) + len(held) == s.config.num_blocks
    for x in live:
        in_transfer = s.transferring.get(x.request_id) is x
        assert in_transfer == (x.status is SequenceStatus.TRANSFERRING)
        assert (x in s.running) == (x.status is SequenceStatus.RUNNING)
        assert (x in s.waiting) == (x.status is SequenceStatus.WAITING)
        if x.status in (SequenceStatus.WAITING, SequenceStatus.FINISHED):
            assert not x.block_table
        else:
            assert len(x.block_table) >= x.num_blocks - 1
        if s.config.role == "decode" and x.remote_kv:
            assert x.status is not SequenceStatus.RUNNING  # runs only after its transfer
