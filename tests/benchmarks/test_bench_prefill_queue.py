"""The prefill queue benchmark's workload: the same mixed-length prompts for the same seed, within range."""
from __future__ import annotations

from benchmarks.bench_prefill_queue import INPUT_LEN, OUTPUT_LEN, mixed_prompts


def test_mixed_prompts_are_deterministic_and_in_range() -> None:
    prompts = mixed_prompts(400, seed=3)
    assert prompts == mixed_prompts(400, seed=3) and prompts != mixed_prompts(400, seed=4)
    lengths = [len(p.prompt_token_ids) for p in prompts]
    assert all(INPUT_LEN[0] <= n <= INPUT_LEN[1] for n in lengths)
    assert all(OUTPUT_LEN[0] <= p.output_len <= OUTPUT_LEN[1] for p in prompts)
    assert max(lengths) + OUTPUT_LEN[1] <= 4096   # the benchmark model's context
    assert sum(n < 512 for n in lengths) > len(lengths) / 2 > sum(n > 2048 for n in lengths) > 0  # mostly short
