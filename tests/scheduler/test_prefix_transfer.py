"""Decode with prefix-aware transfer: cached leading blocks are not pulled, pulled ones join the cache."""
from __future__ import annotations

import pytest

from scheduler import Scheduler, SchedulerConfig, Sequence, SequenceStatus

BLOCK = 4


def decoder(num_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=4, role="decode"),
                     eos_token_ids=[0])


def leg(rid: str, prompt: list[int], max_tokens: int = 3) -> Sequence:
    return Sequence(rid, prompt, max_tokens, ignore_eos=True, block_size=BLOCK, remote_kv=True)


def pulled_turn(s: Scheduler, rid: str, prompt: list[int], first_token: int = 90) -> Sequence:
    """Admits a decode leg and reports its pull done; returns it, RUNNING."""
    s.add(leg(rid, prompt))
    (seq,) = s.admit_transfers()
    s.transfer_done(seq, first_token)
    return seq


def finish(s: Scheduler, seq: Sequence) -> None:
    while not seq.is_finished:
        step = s.schedule()
        s.postprocess(step.sampled, [91] * len(step.sampled))


def test_pulled_full_blocks_join_the_cache_and_the_next_turn_skips_them() -> None:
    s = decoder()
    turn1 = pulled_turn(s, "t1", list(range(1, 11)))     # 2 full blocks + 2 tokens
    assert turn1.num_cached_blocks == 0
    finish(s, turn1)                                      # 13 tokens: decode commits block 2 too
    blocks = [s.block_manager.hash_to_block_id[s.block_manager.blocks[b].hash] for b in range(3)]
    turn2 = leg("t2", turn1.token_ids + [50, 51, 52])    # 16 tokens: the last block holds the last token
    s.add(turn2)
    (admitted,) = s.admit_transfers()
    assert admitted is turn2 and turn2.num_cached_blocks == 3
    assert turn2.block_table[:3] == blocks
    assert all(s.block_manager.blocks[b].ref_count == 1 for b in turn2.block_table)


@pytest.mark.parametrize("cached_len, prompt_len, want_cached", [
    (12, 14, 3),   # everything but the last partial block is cached: one block pulled
    (8, 13, 2),    # the cached prefix ends exactly on a block boundary
    (12, 12, 2),   # a whole prompt cached, block-aligned: its last block (the last token's) is pulled
])
def test_cached_prefix_edges(cached_len: int, prompt_len: int, want_cached: int) -> None:
    s = decoder()
    first = pulled_turn(s, "a", list(range(1, cached_len + 1)))
    s.finish(first, "abort")
    assert s.block_manager.num_free_blocks == 16          # freed, yet still cached
    second = leg("b", list(range(1, prompt_len + 1)))
    s.add(second)
    s.admit_transfers()
    assert second.num_cached_blocks == want_cached
    assert len(second.block_table) - second.num_cached_blocks >= 1
    s.transfer_done(second, 7)
    assert second.output_token_ids == [7] and second.status is SequenceStatus.RUNNING
    step = s.schedule()
    assert [(c.start, c.num_tokens) for c in step.chunks] == [(prompt_len, 1)]


def test_a_failed_pull_frees_its_new_blocks_and_unreferences_the_cached_ones() -> None:
    s = decoder()
    finish(s, pulled_turn(s, "a", list(range(1, 9))))
    holder = pulled_turn(s, "holder", list(range(1, 9)) + [70])   # keeps the cached blocks referenced
    s.add(leg("b", list(range(1, 9)) + [60, 61, 62, 63, 64]))
    (failed,) = s.admit_transfers()
    cached, fresh = failed.block_table[:2], failed.block_table[2:]
    assert [s.block_manager.blocks[b].ref_count for b in cached] == [2, 2]
    s.release(failed, "error")
    assert [s.block_manager.blocks[b].ref_count for b in cached] == [1, 1]
    assert all(b in s.block_manager.free_block_ids for b in fresh)
    assert not any(s.block_manager.blocks[b].hash for b in fresh)   # never pulled: never cached
    s.finish(holder, "abort")
    assert s.block_manager.num_free_blocks == 16 and not s.block_manager.used_block_ids


def test_an_abort_mid_pull_releases_every_block() -> None:
    s = decoder()
    finish(s, pulled_turn(s, "a", list(range(1, 9))))
    s.add(leg("b", list(range(1, 12))))
    (pulling,) = s.admit_transfers()
    assert pulling.num_cached_blocks == 2
    s.finish(pulling, "abort")
    assert pulling.is_finished and s.block_manager.num_free_blocks == 16


def test_two_legs_admitted_together_do_not_share_blocks_not_yet_pulled() -> None:
    s = decoder()
    s.add(leg("a", list(range(1, 10))))
    s.add(leg("b", list(range(1, 10))))
    a, b = s.admit_transfers()
    assert a.num_cached_blocks == b.num_cached_blocks == 0
    assert not set(a.block_table) & set(b.block_table)
