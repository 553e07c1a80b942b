"""The live figures of one interval, as the decision reads them: typed once, parsed from /metrics elsewhere."""
from __future__ import annotations

from dataclasses import dataclass

OTHER = {"prefill": "decode", "decode": "prefill"}   # each role's counterpart


@dataclass(frozen=True, slots=True)
class Counts:
    """Workers per role."""

    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def of(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True, slots=True)
class RoleFigures:
    """One role's workers over the interval, summed (or the mean or max, as named)."""

    workers: int
    prompt_tokens_per_s: float = 0.0        # prompt tokens received: the demand on prefill
    latest_prompt_tokens_per_s: float | None = None   # the same over the last interval alone: a shift shows first
    tail_prompt_tokens_per_s: float | None = None     # ... and over its second half alone (None: not read)
    generated_tokens_per_s: float = 0.0     # tokens produced: the demand met by decode
    requested_tokens_per_s: float | None = None   # output tokens the requests received ask for (max_tokens), times
                                            # the share finished requests produced: the demand on its way (None:
                                            # the workers do not count it)
    latest_requested_tokens_per_s: float | None = None   # the same over the last interval alone
    tail_requested_tokens_per_s: float | None = None     # ... and over its second half alone (None: not read)
    busy_fraction: float = 0.0              # mean share of the interval spent computing steps
    running: float = 0.0                    # requests in the running batches now
    waiting: float = 0.0                    # requests queued now
    kv_used_fraction: float = 0.0           # the fullest worker's KV pool
    prefill_tokens_per_busy_s: float | None = None   # measured prefill speed of one worker (pure prefill steps)
    decode_step_s: float | None = None      # measured mean decode step time ...
    decode_batch: float | None = None       # ... at this mean batch


@dataclass(frozen=True, slots=True)
class Figures:
    """What the fleet did over one interval of `window_s` seconds.

    `samples` is the number of requests whose first token the proxy saw in the interval: the
    percentiles rest on them. The prefill queue's figures are None where no queue exists.
    """

    window_s: float
    samples: int
    ttft_s: float | None
    itl_s: float | None
    prefill: RoleFigures
    decode: RoleFigures
    queue_depth: int | None = None
    queue_wait_s: float | None = None

    def role(self, role: str) -> RoleFigures:
        return self.prefill if role == "prefill" else self.decode
