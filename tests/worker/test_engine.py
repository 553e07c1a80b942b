"""The engine end to end on a tiny checkpoint: batching, sampling, blocks, preemption, aborts."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from worker import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from transfer.layout import KVLayout

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[256] + [rng.randrange(32, 127) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def engine(path: Path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **({"block_size": 4, "num_kv_blocks": 256} | kwargs)))


def run_all(eng: LLMEngine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            return outputs
        outputs.extend(eng.step())
    raise AssertionError("the engine did not finish its requests")


def test_batched_greedy_equals_one_at_a_time(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    ps = prompts(6)
    batched = eng.generate(ps, GREEDY)
    assert [eng.generate([p], GREEDY)[0] for p in ps] == batched
    assert all(len(out) == 20 for out in batched)


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = eng.generate([prompts(1)[0]], seeded)[0]
    others = SamplingParams(max_tokens=16, temperature=1.3, ignore_eos=True)
    in_batch = eng.generate([prompts(1)[0]] + prompts(5, seed=1), [seeded] + [others] * 5)[0]
    assert in_batch == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert eng.generate([prompts(1)[0]], other_seed)[0] != alone


def test_top_k_one_is_greedy(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    ps = prompts(3)
    top1 = SamplingParams(max_tokens=12, temperature=0.8, top_k=1, ignore_eos=True)
    assert eng.generate(ps, top1) == eng.generate(ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))


def test_all_blocks_free_after_32_concurrent_requests(tiny_llama: Path) -> None:
    eng = engine(tiny_llama, max_num_seqs=32)
    for i, p in enumerate(prompts(32)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.7, seed=i, ignore_eos=True))
    outputs = run_all(eng)
    finished = [o for o in outputs if o.finished]
    assert sorted(o.request_id for o in finished) == sorted(f"r{i}" for i in range(32))
    assert all(o.finish_reason == "length" and o.num_output_tokens == 8 for o in finished)
    assert eng.stats().num_blocks_used == 0 and eng.stats().num_running == 0


def test_abort_mid_way_frees_blocks_and_reports_once(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    for i, p in enumerate(prompts(8)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.stats().num_blocks_used > 0
    for i in range(0, 8, 2):
        eng.abort_request(f"r{i}")
    eng.abort_request("unknown")  # no-op
    outputs = run_all(eng)
    aborted = [o for o in outputs if o.finish_reason == "abort"]
    assert sorted(o.request_id for o in aborted) == ["r0", "r2", "r4", "r6"]
    assert all(o.request_id not in {"r0", "r2", "r4", "r6"} for o in outputs if o.finish_reason != "abort")
    assert eng.stats().num_blocks_used == 0
    # An aborted waiting request frees nothing it did not hold and never runs.
    eng.add_request("late", prompts(1)[0], GREEDY)
    eng.abort_request("late")
    assert [o.finish_reason for o in eng.step()] == ["abort"]
    assert not eng.has_unfinished_requests() and eng.stats().num_blocks_used == 0


def test_preemption_under_tiny_pool_keeps_greedy_outputs(tiny_llama: Path) -> None:
    ps = prompts(8, seed=3)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    roomy = engine(tiny_llama).generate(ps, params)
    tiny = engine(tiny_llama, num_kv_blocks=24, enable_prefix_caching=False)
    assert tiny.generate(ps, params) == roomy
    assert tiny.scheduler.num_preemptions > 0
    assert tiny.stats().num_blocks_used == 0


def test_prefix_cache_hits_give_the_same_tokens(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    shared = prompts(1, seed=7)[0] * 2
    first = eng.generate([shared + [65]], GREEDY)[0]
    eng.add_request("again", shared + [65], GREEDY)
    seqs = eng.scheduler.schedule().seqs
    assert seqs[0].num_cached_tokens > 0
    eng.abort_request("again")
    assert [o.finish_reason for o in eng.step()] == ["abort"]
    assert eng.generate([shared + [65]], GREEDY)[0] == first
    assert engine(tiny_llama, enable_prefix_caching=False).generate([shared + [65]], GREEDY)[0] == first


def test_outputs_stream_text_and_counts(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    prompt = prompts(1)[0]
    eng.add_request("s", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    outputs = run_all(eng)
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert len(tokens) == 10 and [o.num_output_tokens for o in outputs] == list(range(1, 11))
    assert all(o.num_prompt_tokens == len(prompt) for o in outputs)
    assert "".join(o.text_delta for o in outputs) == eng.tokenizer.decode(tokens)
    assert [o.finished for o in outputs] == [False] * 9 + [True]


def test_stop_string_truncates_text(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    prompt = prompts(1, seed=5)[0]
    free_run = eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    text = eng.tokenizer.decode(free_run)
    stop = text[10:13]
    eng.add_request("stop", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))
    outputs = run_all(eng)
    assert outputs[-1].finish_reason == "stop"
    assert "".join(o.text_delta for o in outputs) == text[:text.find(stop)]
    assert eng.stats().num_blocks_used == 0


def test_eos_stops_unless_ignored(tiny_llama: Path, tmp_path: Path) -> None:
    prompt = prompts(1, seed=11)[0]
    free_run = engine(tiny_llama).generate([prompt], GREEDY)[0]
    # A copy of the checkpoint whose EOS is the 6th token the model emits greedily.
    shutil.copytree(tiny_llama, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["eos_token_id"] = free_run[5]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    eng = engine(tmp_path / "ckpt")
    assert free_run[5] in eng.tokenizer.eos_token_ids
    stopped = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0]
    assert stopped == free_run[:free_run.index(free_run[5]) + 1]
    assert eng.generate([prompt], GREEDY)[0] == free_run


def test_custom_pool_allocator_is_used(tiny_llama: Path) -> None:
    made: list[torch.Tensor] = []

    def allocate(layout: KVLayout) -> torch.Tensor:
        made.append(torch.full(layout.shape, float("nan"), dtype=layout.torch_dtype))
        return made[0]

    eng = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64), allocate_pool=allocate)
    assert eng.kv_pool is made[0] and eng.kv_layout.shape == tuple(made[0].shape)
    # Garbage in fresh memory (here NaN) must not reach attention through masked slots.
    assert not torch.isnan(eng.kv_pool).any()
    assert eng.generate(prompts(2), GREEDY) == engine(tiny_llama).generate(prompts(2), GREEDY)
    assert eng.kv_pool.abs().sum() > 0  # the model wrote its K/V into this very tensor


def test_wrong_pool_from_allocator_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="allocate_pool"):
        LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8),
                  allocate_pool=lambda layout: torch.zeros(3, dtype=layout.torch_dtype))
