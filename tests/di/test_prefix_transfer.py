"""Prefix-aware transfer between two in-process engines over real shm: a decode worker pulls only
the prompt blocks its prefix cache lacks, a prefill worker computes only the ones its cache lacks,
and the tokens equal a `both` engine's."""
from __future__ import annotations

import time
from typing import Iterator

import pytest

from common.handoff import parse_leg
from tests.di.engine_pair import Recorder, engine_trio, run_pair, tokens, wait_all_free
from worker import LLMEngine, SamplingParams

NUM_BLOCKS = 256
BLOCK = 16


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    with engine_trio(NUM_BLOCKS) as trio:
        yield trio


def chat(engines: tuple[LLMEngine, LLMEngine, LLMEngine], seed: int, params: SamplingParams,
         user_lengths: list[int]) -> list[tuple[list[int], list[int], tuple[int, int], int]]:
    """Turn k's prompt is turn k-1's prompt + answer + new user tokens; each turn's answer must equal
    the `both` engine's. Returns (prompt, answer, (pulled, skipped), prefill start) per turn."""
    prefill, decode, both = engines
    turns, prompt = [], []
    for k, n in enumerate(user_lengths):
        prompt = prompt + tokens(seed * 100 + k, n)
        want = both.generate([prompt], [params])[0]
        with Recorder(prefill, decode) as rec:
            first, (got,) = run_pair(prefill, decode, [prompt], [params])
        assert got == want, f"turn {k}"
        assert first == [want[0]]
        assert len(rec.pulls) == 1 and len(rec.prefill_starts) == 1
        turns.append((prompt, got, rec.pulls[0], rec.prefill_starts[0]))
        prompt = prompt + got
    wait_all_free(prefill, decode)
    return turns


@pytest.mark.parametrize("sampling, seed", [({"temperature": 0.0}, 1), ({"temperature": 0.9, "seed": 5}, 2),
                                            ({"temperature": 1.0, "top_k": 40, "seed": 6}, 3)])
def test_a_multiturn_chat_pulls_only_new_blocks_and_equals_both(engines, sampling: dict, seed: int) -> None:
    assert not engines[0].config.chunked_prefill   # a prefill worker's default: whole prompts
    params = SamplingParams(max_tokens=20, ignore_eos=True, **sampling)
    turns = chat(engines, seed, params, [70, 9, 40, 16])
    moved = skipped = 0
    previous: list[int] = []
    prefill_had = 0                                      # prompt tokens the prefill engine has computed
    for prompt, answer, (pulled, skipped_now), prefill_start in turns:
        num_blocks = (len(prompt) + BLOCK - 1) // BLOCK
        # Decode cached the last turn's prompt and every answer token it computed (not the last one).
        decode_had = max(len(previous) - 1, 0) // BLOCK
        want_skipped = min(decode_had, (len(prompt) - 1) // BLOCK)
        assert (pulled, skipped_now) == (num_blocks - want_skipped, want_skipped)
        assert prefill_start == min(prefill_had // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK
        moved, skipped = moved + pulled, skipped + skipped_now
        previous, prefill_had = prompt + answer, len(prompt)
    assert turns[0][2][1] == 0 and skipped > moved


@pytest.mark.parametrize("extra, want", [
    (5, (1, 3)),     # everything cached but the last partial block
    (16, (1, 3)),    # the cached prefix ends exactly on a block boundary; the last block is whole
    (0, (1, 2)),     # the same prompt again: its last block (the last token's) is pulled
])
def test_cached_prefix_edges(engines, extra: int, want: tuple[int, int]) -> None:
    prefill, decode, both = engines
    head = tokens(1000 + extra, 3 * BLOCK)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    run_pair(prefill, decode, [head], [SamplingParams(max_tokens=1, ignore_eos=True)])
    prompt = head + tokens(2000 + extra, extra)
    with Recorder(prefill, decode) as rec:
        first, got = run_pair(prefill, decode, [prompt], [params])
    assert rec.pulls == [want]
    assert got == both.generate([prompt], [params]) and first == [got[0][0]]   # first token from prefill
    wait_all_free(prefill, decode)


def decode_leg(decode: LLMEngine, prefill: LLMEngine, rid: str, prompt: list[int]) -> None:
    decode.add_request(rid, prompt, SamplingParams(max_tokens=4), parse_leg({
        "role": "decode", "remote_host": "127.0.0.1", "remote_port": prefill.kv_connector.kv_port}))


def step_until_idle(decode: LLMEngine) -> list:
    outputs, deadline = [], time.monotonic() + 10
    while decode.has_unfinished_requests():
        assert time.monotonic() < deadline
        outputs += decode.step()
    return outputs


@pytest.mark.parametrize("how", ["prefill_aborts", "decode_aborts_mid_pull"])
def test_a_pull_that_ends_early_frees_its_blocks_and_keeps_the_cached_ones(engines, how: str) -> None:
    prefill, decode, both = engines
    head = tokens(3000 + len(how), 4 * BLOCK)
    run_pair(prefill, decode, [head], [SamplingParams(max_tokens=1, ignore_eos=True)])
    rid, prompt = f"{how}-{time.monotonic_ns()}", head + tokens(3100, 30)
    if how == "prefill_aborts":
        prefill.add_request(rid, prompt, SamplingParams(max_tokens=1), parse_leg({"role": "prefill"}))
        prefill.abort_request(rid)
        assert [o.finish_reason for o in prefill.step() if o.request_id == rid] == ["abort"]
    decode_leg(decode, prefill, rid, prompt)
    decode.step()                                                # admitted: 4 cached blocks, 2 new ones
    assert decode.stats().num_transferring == 1 and decode.stats().num_blocks_used == 6
    if how == "decode_aborts_mid_pull":
        decode.abort_request(rid)
    ended = [o for o in step_until_idle(decode) if o.request_id == rid]
    assert [o.finish_reason for o in ended] == ["error" if how == "prefill_aborts" else "abort"]
    wait_all_free(prefill, decode)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with Recorder(prefill, decode) as rec:                       # the cached blocks were only unreferenced
        _, got = run_pair(prefill, decode, [prompt], [params])
    assert rec.pulls == [(2, 4)] and got == both.generate([prompt], [params])
    wait_all_free(prefill, decode)


def test_without_prefix_aware_transfer_every_block_is_pulled() -> None:
    with engine_trio(64, prefix_aware_transfer=False) as trio:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        turns = chat(trio, 9, params, [40, 10])
        assert [t[2] for t in turns] == [(3, 0), (4, 0)]
        assert turns[1][3] == 2 * BLOCK                         # the prefill engine still skips its cached blocks
