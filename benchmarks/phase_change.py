"""A trace whose shape changes, and how a fleet met its SLO in each phase (pure: no I/O).

Phases, each a Poisson stream of prompts of random token ids: short chat turns, long documents (prefill
heavy), long generations (decode heavy), chat again, then a quiet spell. Rates are given for a budget of
12 workers and scale with the budget. A request meets the SLO when it succeeds with TTFT and TPOT (its
mean time per output token after the first) within their targets.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from benchmarks.serving_load import TOKEN_ID_RANGE, SyntheticRequest, arrival_offsets
from benchmarks.serving_metrics import RequestResult

REFERENCE_BUDGET = 12
CUT = "cut at the end of the run"


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    rate: float                    # requests per second for a budget of REFERENCE_BUDGET workers
    input_len: tuple[int, int]
    output_len: tuple[int, int]


PHASES = (
    Phase("chat", 4.0, (100, 300), (30, 60)),
    Phase("documents", 3.6, (2000, 3000), (8, 16)),
    Phase("generations", 2.5, (100, 300), (100, 300)),
    Phase("chat again", 4.0, (100, 300), (30, 60)),
    Phase("quiet", 0.6, (100, 300), (30, 60)),
)
# The simulated engine the trace is sized for (python -m worker --engine mock flags), and the SLO.
MOCK_COSTS = {"prefill_tokens_per_s": 1500.0, "decode_base_ms": 100.0, "decode_per_seq_ms": 10.0}
TTFT_TARGET_S = 3.0
TPOT_TARGET_S = 0.25


@dataclass(frozen=True, slots=True)
class Arrival:
    offset_s: float
    phase: int
    request: SyntheticRequest


def trace(phases: Sequence[Phase], seconds: float, budget: int, seed: int) -> list[Arrival]:
    """Each phase `seconds` long, its arrivals Poisson at its rate scaled to `budget`."""
    arrivals: list[Arrival] = []
    rng = random.Random(seed)
    for index, phase in enumerate(phases):
        rate = phase.rate * budget / REFERENCE_BUDGET
        count = max(1, round(rate * seconds * 1.5))   # more than the phase holds; the ones past its end are cut
        offsets = [o for o in arrival_offsets(count, rate, seed + index) if o < seconds]
        for offset in offsets:
            prompt = [rng.randint(*TOKEN_ID_RANGE) for _ in range(rng.randint(*phase.input_len))]
            arrivals.append(Arrival(index * seconds + offset, index, SyntheticRequest(prompt, rng.randint(*phase.output_len))))
    return arrivals


def met(result: RequestResult, ttft_s: float = TTFT_TARGET_S, tpot_s: float = TPOT_TARGET_S) -> bool:
    """Whether a request met the SLO; one cut at the end of a run is judged on the tokens it received."""
    if not result.chunk_times or result.error not in (None, CUT) or result.ttft > ttft_s:
        return False
    itls = result.itls
    tpot = result.tpot if result.error is None else (sum(itls) / len(itls) if itls else None)
    return tpot is None or tpot <= tpot_s


def attainment_by_phase(arrivals: Sequence[Arrival], results: Sequence[RequestResult], phases: int,
                        skip_first_s: float = 0.0, seconds: float = 0.0) -> list[float | None]:
    """The share of each phase's requests that met the SLO (those arriving in its first `skip_first_s` aside)."""
    shares: list[float | None] = []
    for phase in range(phases):
        judged = [met(r) for a, r in zip(arrivals, results)
                  if a.phase == phase and a.offset_s - phase * seconds >= skip_first_s]
        shares.append(sum(judged) / len(judged) if judged else None)
    return shares


def rolling_attainment(arrivals: Sequence[Arrival], results: Sequence[RequestResult], window_s: float,
                       end_s: float) -> list[tuple[float, float | None]]:
    """(window start, share met) of the requests arriving in each `window_s` window."""
    points = []
    start = 0.0
    while start < end_s:
        judged = [met(r) for a, r in zip(arrivals, results) if start <= a.offset_s < start + window_s]
        points.append((start, sum(judged) / len(judged) if judged else None))
        start += window_s
    return points


def request_rows(arrivals: Sequence[Arrival], results: Sequence[RequestResult]) -> list[list]:
    """Each request as [arrival s, phase, prompt tokens, TTFT s, TPOT s, met, error], for reading a run's misses."""
    rows = []
    for a, r in zip(arrivals, results):
        ttft = round(r.ttft, 3) if r.chunk_times else None
        tpot = r.tpot if r.chunk_times and r.error is None else None
        rows.append([round(a.offset_s, 2), a.phase, len(a.request.prompt_token_ids), ttft,
                     None if tpot is None else round(tpot, 4), met(r), r.error])
    return rows


def recovery_s(arrivals: Sequence[Arrival], results: Sequence[RequestResult], phase: int, seconds: float,
               window_s: float = 5.0, level: float = 0.9) -> float | None:
    """Seconds from the phase's start until the requests arriving in every `window_s` window from then on,
    within the phase, met the SLO at `level` or better; None if that never happened."""
    start = phase * seconds
    windows = [(t, share) for t, share in rolling_attainment(arrivals, results, window_s, start + seconds)
               if t >= start]
    for i, (t, _) in enumerate(windows):
        rest = [share for _, share in windows[i:] if share is not None]
        if all(share >= level for share in rest):
            return t - start
    return None
