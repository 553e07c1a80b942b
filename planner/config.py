"""The planner's targets, budget and rules, checked once: a bad value is a ConfigError naming its flag."""
from __future__ import annotations

import math
from dataclasses import dataclass

from planner.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """SLO targets, the worker budget, per-role bounds and the settings of the decision's rules.

    Utilization is the share of a role's capacity its load needs (prefill: prompt tokens per second
    against the measured prefill speed; decode: tokens per second against what a worker yields at the ITL
    target). A role is scaled up when its utilization passes `utilization_up`, down only when it stays
    under `utilization_down` for `scale_down_after` intervals in a row; either way to `utilization_target`.
    """

    ttft_target_s: float
    itl_target_s: float
    budget: int
    min_prefill: int = 1
    max_prefill: int | None = None     # None: the budget
    min_decode: int = 1
    max_decode: int | None = None
    interval_s: float = 5.0
    cooldown_s: float = 20.0           # no change within this long of the last one
    min_samples: int = 10              # requests with a first token in the interval before scaling up
    scale_down_after: int = 3
    percentile: float = 0.9
    utilization_up: float = 0.8
    utilization_target: float = 0.65
    utilization_down: float = 0.45
    max_batch: int = 16                # the decode workers' --max-num-seqs
    kv_high: float = 0.9               # decode KV use that counts as pressure
    # Speeds assumed until measured (a profile of the worker; the simulated engine's defaults otherwise)
    prefill_tokens_per_s: float = 1856.0
    decode_base_s: float = 0.0094
    decode_per_seq_s: float = 0.00055

    def __post_init__(self) -> None:
        positive = {"--ttft-target-ms": (self.ttft_target_s, 1000), "--itl-target-ms": (self.itl_target_s, 1000),
                    "--interval": (self.interval_s, 1), "--prefill-tokens-per-s": (self.prefill_tokens_per_s, 1)}
        for flag, (value, scale) in positive.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} must be a positive number, got {value * scale:g}")
        if not isinstance(self.budget, int) or self.budget < 2:
            raise ConfigError(f"--budget must be an integer of at least 2 (a prefill and a decode worker), "
                              f"got {self.budget!r}")
        for flag, value in {"--min-prefill": self.min_prefill, "--min-decode": self.min_decode}.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value!r}")
        if self.min_prefill + self.min_decode > self.budget:
            raise ConfigError(f"--budget {self.budget} is less than --min-prefill {self.min_prefill} plus "
                              f"--min-decode {self.min_decode}")
        for flag, low, high in (("--max-prefill", self.min_prefill, self.max_prefill),
                                ("--max-decode", self.min_decode, self.max_decode)):
            if high is not None and not low <= high <= self.budget:
                raise ConfigError(f"{flag} must be between its minimum {low} and --budget {self.budget}, got {high}")
        if not 0 < self.percentile < 1:
            raise ConfigError(f"--percentile must be between 0 and 1, got {self.percentile}")
        if not 0 < self.utilization_down < self.utilization_target < self.utilization_up <= 1:
            raise ConfigError("utilizations must satisfy 0 < --utilization-down < --utilization-target < "
                              f"--utilization-up <= 1, got {self.utilization_down}, {self.utilization_target}, "
                              f"{self.utilization_up}")
        for flag, value in {"--cooldown": self.cooldown_s, "--min-samples": self.min_samples,
                            "--decode-base-ms": self.decode_base_s, "--decode-per-seq-ms": self.decode_per_seq_s}.items():
            if value < 0:
                raise ConfigError(f"{flag} must not be negative, got {value}")
        if self.scale_down_after < 1 or self.max_batch < 1:
            raise ConfigError("--scale-down-after and --max-batch must be at least 1")
        if self.decode_base_s + self.decode_per_seq_s >= self.itl_target_s:
            raise ConfigError(f"--itl-target-ms {self.itl_target_s * 1000:g} is below the decode step time of one "
                              f"sequence ({(self.decode_base_s + self.decode_per_seq_s) * 1000:g} ms): no fleet meets it")

    def bounds(self, role: str) -> tuple[int, int]:
        """The least and most workers of `role`."""
        if role == "prefill":
            return self.min_prefill, self.max_prefill or self.budget - self.min_decode
        return self.min_decode, self.max_decode or self.budget - self.min_prefill
