"""Per-request sampling parameters."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.openai_wire import SEED_MAX, SEED_MIN
from worker.errors import invalid


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; invalid values raise InvalidRequestError (a ValueError) naming the field."""

    max_tokens: int = 16
    temperature: float = 1.0          # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 -> disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise invalid(f"max_tokens must be an int >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise invalid(f"temperature must be a number in [0, 100], got {self.temperature!r}", "temperature")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise invalid(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise invalid(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise invalid(f"seed must be an int in [-2**63, 2**63) or None, got {self.seed!r}", "seed")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise invalid(f"stop must be a list of non-empty strings, got {self.stop!r}", "stop")
        if not isinstance(self.ignore_eos, bool):
            raise invalid(f"ignore_eos must be a bool, got {self.ignore_eos!r}", "ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and value == value
