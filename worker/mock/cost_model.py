"""How long a simulated engine step takes: prompt tokens at a prefill rate, decodes at a step time that
grows with the batch. Calibrated from `python -m benchmarks.bench_engine --json` or given by flags."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from scheduler import ScheduledStep
from worker.engine.step_counters import step_shape

# benchmarks/results/engine_bench24m.json: the ~24M benchmark model, one thread, on the 2-core machine
# the project is developed on (prefill 1856 tok/s at batch 8; decode 101 tok/s at batch 1, 581 at batch 8).
DEFAULT_PREFILL_TOKENS_PER_S = 1856.0
DEFAULT_DECODE_BASE_S = 0.00938
DEFAULT_DECODE_PER_SEQ_S = 0.00055


@dataclass(frozen=True, slots=True)
class CostModel:
    """A step computing p prompt tokens and d decodes takes p / prefill_tokens_per_s seconds, plus
    decode_base_s + d * decode_per_seq_s when d > 0."""

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    decode_base_s: float = DEFAULT_DECODE_BASE_S
    decode_per_seq_s: float = DEFAULT_DECODE_PER_SEQ_S

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill tokens per second must be positive, got {self.prefill_tokens_per_s:g}")
        if self.decode_base_s < 0 or self.decode_per_seq_s < 0 or self.decode_base_s + self.decode_per_seq_s <= 0:
            raise ValueError(f"decode step time must be positive, got base {self.decode_base_s:g} s and "
                             f"{self.decode_per_seq_s:g} s per sequence")

    @classmethod
    def from_bench_engine(cls, path: str | Path) -> CostModel:
        """The costs a `bench_engine` JSON report measured: prefill at batch 8, and the decode step time's
        line through batch 1 and batch 8. ValueError naming the file when it is not such a report."""
        try:
            report = json.loads(Path(path).read_text())
            step_1 = 1.0 / report["decode_b1_tok_s"]
            step_8 = 8.0 / report["decode_b8_tok_s"]
            per_seq = max((step_8 - step_1) / 7.0, 0.0)
            return cls(float(report["prefill_b8_tok_s"]), max(step_1 - per_seq, 0.0), per_seq)
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
            raise ValueError(f"{path} is not a bench_engine report: {exc!r}") from exc

    def step_seconds(self, step: ScheduledStep) -> float:
        prompt_tokens, decodes = step_shape(step)
        seconds = prompt_tokens / self.prefill_tokens_per_s
        if decodes:
            seconds += self.decode_base_s + decodes * self.decode_per_seq_s
        return seconds
