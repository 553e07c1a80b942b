"""Per-request sampling parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.openai_wire import SEED_MAX, SEED_MIN
from worker.errors import invalid

MAX_LOGPROBS = 20        # most logprobs a token or prompt position may ask for (vLLM's default --max-logprobs)
MAX_LOGIT_BIAS = 100.0   # a bias is clamped to [-100, 100], as OpenAI and vLLM do


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; invalid values raise InvalidRequestError (a ValueError) naming the field.

    Penalties, `logit_bias` and `min_tokens` change the logits a token is picked from, in vLLM's order
    (min_tokens, logit_bias, repetition, frequency, presence); `logprobs` report the model's own
    distribution (log-softmax of the raw logits), as vLLM's default `raw_logprobs` mode does.
    """

    max_tokens: int = 16
    temperature: float = 1.0          # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 -> disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0               # EOS and stop_token_ids cannot be sampled, nor stop strings end it, before
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None          # per output token: its logprob and the top `logprobs`; -1: every token
    prompt_logprobs: int | None = None   # the same for every prompt token but the first
    grammar: str | None = None           # structured output: an llguidance grammar the output must match

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
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise invalid(f"seed must be an int in [-2**63, 2**63) or None, got {self.seed!r}", "seed")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise invalid(f"stop must be a list of non-empty strings, got {self.stop!r}", "stop")
        if not isinstance(self.ignore_eos, bool):
            raise invalid(f"ignore_eos must be a bool, got {self.ignore_eos!r}", "ignore_eos")
        self._check_logits_processing()
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise invalid(f"grammar must be an llguidance grammar (a string), got {self.grammar!r}", "response_format")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and (value >= 0 or value == -1)):
                raise invalid(f"{name} must be an int >= 0 or -1 (every token), got {value!r}", name)

    def _check_logits_processing(self) -> None:
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise invalid(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                          "min_tokens")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise invalid(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}", "stop_token_ids")
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise invalid(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}",
                          "repetition_penalty")
        if not isinstance(self.logit_bias, dict) or not all(
                _is_int(t) and _is_number(b) for t, b in self.logit_bias.items()):
            raise invalid(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}", "logit_bias")
        self.logit_bias = {t: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(b))) for t, b in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether a token is picked from other than the model's raw logits (min_p aside: only random rows use it)."""
        return bool(self.min_tokens or self.logit_bias or self.has_penalties)


def _check_range(name: str, value: object, low: float, high: float) -> None:
    if not _is_number(value) or not low <= value <= high:   # type: ignore[operator]  # a number by then
        raise invalid(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and value == value
