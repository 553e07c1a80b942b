"""Chunked prefill in the engine: same tokens as whole-prompt prefill, and streams keep decoding."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from worker import EngineConfig, LLMEngine, SamplingParams
from worker.server.cli import parse_args

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)


def prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    """Prompts of 1-70 tokens; the first `shared` tokens are the same in all (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [256] + [rng.randrange(32, 127) for _ in range(shared)]
    return [prefix + [rng.randrange(32, 127) for _ in range(rng.randrange(0, 70))] for _ in range(n)]


def engine(path: Path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **({"block_size": 4, "num_kv_blocks": 256} | kwargs)))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("shared", [0, 21], ids=["distinct", "shared-prefix"])
def test_chunked_equals_whole_prompt_prefill(tiny_llama: Path, params: SamplingParams, shared: int) -> None:
    ps = prompts(10, shared=shared)
    whole = engine(tiny_llama, enable_chunked_prefill=False).generate(ps, params)
    chunked = engine(tiny_llama, enable_chunked_prefill=True, max_num_batched_tokens=16)
    assert chunked.generate(ps, params) == whole
    assert chunked.stats().num_blocks_used == 0


def test_short_prompts_alone_ahead_of_decodes_keep_outputs(tiny_llama: Path) -> None:
    ps = prompts(10, seed=1)
    whole = engine(tiny_llama, enable_chunked_prefill=False).generate(ps, GREEDY)
    paused = engine(tiny_llama, enable_chunked_prefill=True, max_num_batched_tokens=16, short_prompt_tokens=40,
                    decode_pause_tokens=32)
    assert paused.generate(ps, GREEDY) == whole
    assert paused.stats().num_blocks_used == 0


def test_preemption_with_chunks_keeps_outputs(tiny_llama: Path) -> None:
    ps = prompts(8, seed=3)
    whole = engine(tiny_llama, enable_chunked_prefill=False).generate(ps, GREEDY)
    tiny = engine(tiny_llama, num_kv_blocks=30, enable_chunked_prefill=True, max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    assert tiny.generate(ps, GREEDY) == whole
    assert tiny.scheduler.num_preemptions > 0 and tiny.stats().num_blocks_used == 0


def test_a_long_prompt_does_not_stall_running_streams(tiny_llama: Path) -> None:
    eng = engine(tiny_llama, enable_chunked_prefill=True, max_num_batched_tokens=16, short_prompt_tokens=100)
    streams = prompts(3, seed=5)
    for i, p in enumerate(streams):
        eng.add_request(f"s{i}", p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    while len(eng.scheduler.running) < 3 or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    eng.add_request("long", [256] + [65 + i % 26 for i in range(200)], GREEDY)
    steps = 0
    while True:
        produced = {out.request_id for out in eng.step()}
        steps += 1
        assert {"s0", "s1", "s2"} <= produced, f"a running stream got no token in step {steps}"
        if "long" in produced:
            break
    assert steps >= 200 // 16  # the prompt really was prefilled in chunks


@pytest.mark.parametrize("role, chunked, short", [("both", True, 1024), ("decode", True, 0), ("prefill", False, 0)])
def test_chunked_prefill_default_per_role(role: str, chunked: bool, short: int) -> None:
    config = EngineConfig(role=role)
    assert config.chunked_prefill is chunked
    assert config.token_budget == (512 if chunked else 4096)
    assert config.short_prompts == short and config.decode_pause_tokens == 4096


def test_budget_below_max_num_seqs_is_refused() -> None:
    with pytest.raises(ValueError, match="must be at least max_num_seqs"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    assert EngineConfig(max_num_seqs=16, max_num_batched_tokens=8, enable_chunked_prefill=False).token_budget == 8
    assert EngineConfig(max_num_seqs=1024).token_budget == 1024   # the default budget grows to fit the decodes


def test_cli_flags_set_chunking_and_budget(capsys: pytest.CaptureFixture[str]) -> None:
    _, config = parse_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048",
                            "--no-enable-prefix-caching"])
    assert not config.chunked_prefill and config.token_budget == 2048 and not config.enable_prefix_caching
    _, config = parse_args(["--role", "prefill", "--enable-chunked-prefill"])
    assert config.chunked_prefill and config.token_budget == 512
    assert config.short_prompts == 0   # no chunks on a prefill worker: nothing to run ahead of
    _, config = parse_args(["--short-prompt-tokens", "300", "--decode-pause-tokens", "2048"])
    assert (config.short_prompts, config.decode_pause_tokens) == (300, 2048)
    for flag, low in (("--short-prompt-tokens", 0), ("--decode-pause-tokens", 1)):
        with pytest.raises(SystemExit) as exc:
            parse_args([flag, "-1"])
        assert exc.value.code == 2 and f"must be at least {low}, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        parse_args(["--max-num-batched-tokens", "4"])
    assert exc.value.code == 2 and "must be at least max_num_seqs" in capsys.readouterr().err
