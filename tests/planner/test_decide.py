"""The decision, pure: property tests over a fleet model whose latency follows its utilization."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.config import PlannerConfig
from planner.decide import PEAK_MEMORY, Decision, PlannerState, decide, decode_capacity
from planner.errors import ConfigError
from planner.figures import Counts, Figures, RoleFigures

CONFIG = PlannerConfig(ttft_target_s=2.0, itl_target_s=0.1, budget=12, cooldown_s=20, interval_s=5,
                       min_samples=10, scale_down_after=3)


def figures(loads: tuple[float, float], counts: Counts, config: PlannerConfig = CONFIG, samples: int = 100) -> Figures:
    """What a fleet of `counts` reports under `loads` (workers' worth of prefill and decode): latencies miss
    their targets when a role runs past 95% of its capacity."""
    load_p, load_d = loads
    busy_p, busy_d = load_p / max(counts.prefill, 1), load_d / max(counts.decode, 1)
    _, capacity = decode_capacity(RoleFigures(0), config)
    return Figures(
        window_s=config.interval_s, samples=samples,
        ttft_s=config.ttft_target_s * (2.0 if busy_p > 0.95 else 0.5),
        itl_s=config.itl_target_s * (1.5 if busy_d > 0.95 else 0.6),   # the model's decode batch is not shown
        prefill=RoleFigures(counts.prefill, prompt_tokens_per_s=load_p * config.prefill_tokens_per_s,
                            busy_fraction=min(busy_p, 1.0), prefill_tokens_per_busy_s=config.prefill_tokens_per_s),
        decode=RoleFigures(counts.decode, generated_tokens_per_s=load_d * capacity, busy_fraction=1.0))


def prompts(figs: Figures, latest: float | None = None, tail: float | None = None) -> Figures:
    """`figs` with prefill's prompt demand over the last interval and over that interval's tail, in workers'
    worth (None: as it was)."""
    speed = CONFIG.prefill_tokens_per_s
    rates = {name: value * speed for name, value in (("latest_prompt_tokens_per_s", latest),
                                                      ("tail_prompt_tokens_per_s", tail)) if value is not None}
    return replace(figs, prefill=replace(figs.prefill, **rates))


def run(loads: list[tuple[float, float]], start: Counts, config: PlannerConfig = CONFIG,
        fixed: bool = False) -> list[Counts]:
    """The fleet's counts after each interval, the decision applied at once."""
    counts, state, history = start, PlannerState(), []
    for i, interval_loads in enumerate(loads):
        decision, state = decide(figures(interval_loads, counts, config), counts, state, config, i * config.interval_s,
                                 fixed_fleet=fixed)
        counts = decision.target
        history.append(counts)
    return history


load = st.floats(min_value=0.0, max_value=15.0)
counts = st.builds(Counts, st.integers(1, 11), st.integers(1, 11)).filter(lambda c: c.total <= 12)


@settings(max_examples=300, deadline=None)
@given(load, load, counts, st.integers(2, 12), st.integers(0, 200))
def test_never_exceeds_the_budget_or_the_bounds(load_p: float, load_d: float, start: Counts, budget: int,
                                                samples: int) -> None:
    config = replace(CONFIG, budget=budget, max_prefill=None, max_decode=None)
    start = Counts(min(start.prefill, budget - 1), min(start.decode, budget - min(start.prefill, budget - 1)))
    decision, _ = decide(figures((load_p, load_d), start, config, samples), start, PlannerState(), config, 0.0)
    assert decision.target.total <= budget
    assert decision.target.prefill >= 1 and decision.target.decode >= 1


@settings(max_examples=200, deadline=None)
@given(load, load, counts, st.floats(min_value=0.0, max_value=0.05))
def test_never_flaps_under_steady_load(load_p: float, load_d: float, start: Counts, noise: float) -> None:
    """A steady load (with a few percent of noise) never moves a count back: each role's count only goes one
    way, in at most two steps (a role that grows first takes the other's spare workers, the rest of which go
    once the whole fleet is quiet), and then stays."""
    steady = [(load_p * (1 + noise * (-1) ** i), load_d * (1 - noise * (-1) ** i)) for i in range(60)]
    history = [start] + run(steady, start)
    for role in ("prefill", "decode"):
        values = [c.of(role) for c in history]
        moves = [b - a for a, b in zip(values, values[1:]) if a != b]
        assert len(moves) <= 2 and (all(m > 0 for m in moves) or all(m < 0 for m in moves)), (role, values)
    assert history[-10:] == [history[-1]] * 10


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=3.0, max_value=6.0), st.floats(min_value=3.0, max_value=6.0),
       st.floats(min_value=0.05, max_value=0.3))
def test_scales_down_when_load_drops(load_p: float, load_d: float, drop: float) -> None:
    history = run([(load_p, load_d)] * 10 + [(load_p * drop, load_d * drop)] * 20, Counts(1, 1))
    high, low = history[9], history[-1]
    assert low.total < high.total
    assert low.prefill >= 1 and low.decode >= 1


def test_no_action_on_too_few_samples_or_without_figures() -> None:
    start = Counts(2, 2)
    decision, _ = decide(figures((1.8, 1.8), start, samples=3), start, PlannerState(), CONFIG, 0.0)
    assert not decision.changed and "too few samples" in decision.reason   # 90%: a few requests' noise
    decision, _ = decide(None, start, PlannerState(), CONFIG, 0.0, "metrics missing (http://w: HTTP 500)")
    assert not decision.changed and decision.reason == "hold: metrics missing (http://w: HTTP 500)"


def test_a_role_past_its_capacity_grows_on_few_samples() -> None:
    """A saturated role delays the first tokens the samples count: past full capacity its counters are enough."""
    start = Counts(2, 2)
    decision, _ = decide(figures((0.5, 2.4), start, samples=3), start, PlannerState(), CONFIG, 0.0)
    assert decision.changed and decision.target.decode > 2 and decision.target.prefill == 2


def test_cooldown_holds_steps_down_after_a_change_not_steps_up() -> None:
    start = Counts(1, 1)
    decision, state = decide(figures((3.0, 0.5), start), start, PlannerState(), CONFIG, 0.0)
    assert decision.changed and decision.target.prefill == 5
    down = replace(CONFIG, scale_down_after=1)
    forgotten = replace(state, recent_loads=((), ()))   # no recent peak holds the step down: the cool-down must
    later, _ = decide(figures((0.2, 0.1), decision.target), decision.target, forgotten, down, 10.0)
    assert not later.changed and "cooling down" in later.reason
    later, _ = decide(figures((5.0, 0.5), decision.target), decision.target, state, CONFIG, 10.0)
    assert later.changed and later.target.prefill == 8


def test_within_the_cooldown_a_fixed_fleet_goes_on_only_toward_the_role_still_saturated() -> None:
    """A shift not yet met (prefill still past utilization_up after a first flip) flips on at once; turning
    back toward decode waits for the cool-down to end."""
    config = replace(CONFIG, min_samples=1)
    start = Counts(2, 10)
    first, state = decide(figures((4.0, 0.5), start, config), start, PlannerState(), config, 0.0, fixed_fleet=True)
    assert first.changed and first.target.prefill > 2 and state.last_grown == "prefill"
    again, state = decide(figures((9.0, 0.5), first.target, config), first.target, state, config, 5.0,
                          fixed_fleet=True)
    assert again.changed and again.target.prefill > first.target.prefill
    back, _ = decide(figures((0.5, 9.0), again.target, config), again.target, state, config, 10.0, fixed_fleet=True)
    assert not back.changed and "cooling down" in back.reason
    later, _ = decide(figures((0.5, 9.0), again.target, config), again.target, state, config, 30.0, fixed_fleet=True)
    assert later.changed and later.target.decode > again.target.decode


def test_a_shift_in_prompts_counts_from_the_last_interval_before_the_window_shows_it() -> None:
    """Long prompts begin: the window's mean still reads one prefill worker's worth, the last interval six."""
    start = Counts(4, 8)
    shifted = figures((1.0, 2.0), start)
    window_only, _ = decide(shifted, start, PlannerState(), CONFIG, 0.0)
    assert not window_only.changed
    latest = prompts(shifted, latest=6)
    decision, _ = decide(latest, start, PlannerState(), CONFIG, 0.0)
    assert decision.changed and decision.target.prefill >= 8 and decision.loads["prefill"] == pytest.approx(6.0)


def test_long_generations_count_from_the_tokens_they_ask_for_before_they_are_produced() -> None:
    """Long generations begin: the tokens produced and the streams in flight still read two decode workers'
    worth, the tokens the requests admitted ask for eight."""
    start = Counts(4, 4)
    shifted = figures((1.0, 2.0), start)
    produced_only, _ = decide(shifted, start, PlannerState(), CONFIG, 0.0)
    assert not produced_only.changed
    _, capacity = decode_capacity(RoleFigures(0), CONFIG)
    asked = replace(shifted, decode=replace(shifted.decode, requested_tokens_per_s=8 * capacity))
    decision, _ = decide(asked, start, PlannerState(), CONFIG, 0.0)
    assert decision.changed and decision.target.decode >= 8 and decision.loads["decode"] == pytest.approx(8.0)


def at_10p2d(loads: tuple[float, float], latest: float | None = None,
             tail: float | None = None) -> tuple[Decision, PlannerState]:
    """The decision (and state) of a fixed fleet at 10P2D (documents were the traffic) under `loads`, prefill's
    demand over the last interval and its tail as given (see prompts)."""
    config = replace(CONFIG, min_samples=1)
    return decide(prompts(figures(loads, Counts(10, 2), config), latest, tail), Counts(10, 2), PlannerState(),
                  config, 0.0, fixed_fleet=True)


def test_in_a_shift_the_role_that_gives_workers_up_gives_by_its_last_interval_in_one_step() -> None:
    """Documents end and long generations begin at 10P2D: the prefill window still reads 4.3 workers' worth,
    its last interval 0.2. Decode takes the workers prefill no longer needs at once, not in two steps."""
    assert at_10p2d((4.3, 13.2))[0].target == Counts(2, 10)
    decision, _ = at_10p2d((4.3, 13.2), latest=0.2)
    assert decision.target == Counts(1, 11) and "prefill gives by its latest load 0.20" in decision.reason
    assert not at_10p2d((4.3, 1.0), latest=0.2)[0].changed   # no shift: the window's mean stands, noise moves nothing


def test_in_a_shift_the_split_rounds_toward_the_role_the_traffic_shifts_to() -> None:
    """Long generations begin at 10P2D while the prefill's last interval still holds the documents' tail (1.9
    workers of the budget's proportion): decode gets the fraction, and the fleet is at 1P11D in one step where
    rounding gave 2P10D and decode took the last worker an interval later."""
    config = replace(CONFIG, min_samples=1)
    decision, state = at_10p2d((4.4, 18.9), latest=3.5)
    assert decision.target == Counts(1, 11), decision.reason
    assert "prefill gives by its latest load 3.50" in decision.reason
    after, _ = decide(figures((0.6, 11.4), decision.target, config), decision.target, state, config,
                      config.interval_s, fixed_fleet=True)
    assert not after.changed, after.reason


def test_in_a_shift_the_giving_role_gives_by_its_last_intervals_tail_where_that_is_lower() -> None:
    """Long generations begin at 10P2D just after a last cluster of documents: prefill's last interval reads
    4.2 workers' worth (2P10D by the proportion, and decode took the last worker an interval later), the
    second half of that interval 0.3: the fleet is at 1P11D in one step."""
    assert at_10p2d((4.2, 13.5), latest=4.2)[0].target == Counts(2, 10)
    decision, _ = at_10p2d((4.2, 13.5), latest=4.2, tail=0.3)
    assert decision.target == Counts(1, 11) and "prefill gives by its latest load 0.30" in decision.reason
    assert not at_10p2d((4.3, 1.0), tail=0.0)[0].changed   # no shift: a quiet tail moves nothing


def test_a_burst_past_the_budget_takes_no_worker_the_other_role_needs() -> None:
    """A burst of documents at 9P3D takes prefill to 114% while decode runs at 47%: no shift, so decode keeps
    the 2 workers that keep it under utilization_up (the proportion gave it 1, and it asked for it back)."""
    config = replace(CONFIG, min_samples=1)
    burst = figures((10.23, 1.41), Counts(9, 3), config)
    kept, _ = decide(burst, Counts(9, 3), PlannerState(), config, 0.0, fixed_fleet=True)
    assert kept.target.decode >= 2, kept.reason


def test_within_the_cooldown_an_slo_miss_the_load_explains_grows_the_same_role_on() -> None:
    config = replace(CONFIG, min_samples=1)
    start, state = Counts(6, 6), PlannerState(last_change_at=0.0, last_grown="decode")
    steady = figures((0.2, 4.5), start, config)   # decode at 75%: under utilization_up
    held, _ = decide(steady, start, state, config, 5.0, fixed_fleet=True)
    assert not held.changed
    missing = replace(steady, itl_s=config.itl_target_s * 2, decode=replace(steady.decode, waiting=3))   # queued
    grown, _ = decide(missing, start, state, config, 5.0, fixed_fleet=True)
    assert grown.changed and grown.target.decode > 6 and "ITL" in grown.reason

    on_their_way, _ = decide(missing, start, state, config, 5.0, fixed_fleet=True, arriving=Counts(0, 2))
    assert not on_their_way.changed and "2 on their way" in on_their_way.reason
    past_up = replace(missing, decode=replace(missing.decode,
                                              generated_tokens_per_s=missing.decode.generated_tokens_per_s * 1.2))
    grown_by_load, _ = decide(past_up, start, state, config, 5.0, fixed_fleet=True, arriving=Counts(0, 2))
    assert grown_by_load.changed and grown_by_load.target.decode > 6   # its load alone still grows it


def test_a_decode_miss_while_its_batches_keep_the_itl_target_is_not_the_loads() -> None:
    """Documents at 10P2D: the two decode workers at 75% run batches under the one whose step keeps the ITL
    target, yet ITL p90 reads 125 ms against 100: the gaps over it are streams' first, their KV's pull. A worker
    more would shorten none: hold. With streams queued, or batches past that one, the miss grows decode."""
    config = replace(CONFIG, min_samples=1)
    start = Counts(10, 2)
    base = figures((4.5, 1.5), start, config)
    batch, _ = decode_capacity(base.decode, config)
    missing = replace(base, itl_s=config.itl_target_s * 1.25, decode=replace(base.decode, running=batch))
    held, _ = decide(missing, start, PlannerState(), config, 100.0, fixed_fleet=True)
    assert not held.changed and "(nothing waits for its workers): steady" in held.reason, held.reason
    for busy in (replace(missing.decode, waiting=1), replace(missing.decode, running=2 * batch + 1)):
        grown, _ = decide(replace(missing, decode=busy), start, PlannerState(), config, 100.0, fixed_fleet=True)
        assert grown.target.decode >= 3 and "ITL" in grown.reason, grown.reason


def test_at_the_budget_the_split_follows_the_needs() -> None:
    """Long prompts at 1P2D within a budget of 3: a decode worker becomes a prefill worker."""
    config = replace(CONFIG, budget=3, min_samples=1)
    start = Counts(1, 2)
    decision, _ = decide(figures((1.0, 0.1), start, config), start, PlannerState(), config, 0.0)
    assert decision.target == Counts(2, 1)


@pytest.mark.parametrize("change, flag", [
    (dict(budget=1), "--budget"), (dict(ttft_target_s=0.0), "--ttft-target-ms"),
    (dict(itl_target_s=float("nan")), "--itl-target-ms"), (dict(min_prefill=8, min_decode=8), "--budget 12"),
    (dict(max_decode=20), "--max-decode"), (dict(itl_target_s=0.005), "--itl-target-ms")])
def test_a_bad_target_or_budget_names_its_flag(change: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        replace(CONFIG, **change)


@settings(max_examples=200, deadline=None)
@given(load, load, counts)
def test_a_fixed_fleet_keeps_its_total(load_p: float, load_d: float, start: Counts) -> None:
    """Role flips only: the split moves, the number of workers never does."""
    history = run([(load_p, load_d)] * 30, start, fixed=True)
    assert all(c.total == start.total and c.prefill >= 1 and c.decode >= 1 for c in history)


def test_a_fixed_fleet_flips_a_decode_worker_to_prefill_when_prompts_grow() -> None:
    config = replace(CONFIG, min_samples=1)
    history = run([(0.2, 0.3)] * 10 + [(1.0, 0.1)] * 10, Counts(1, 2), config, fixed=True)
    assert history[9] == Counts(1, 2) and history[-1] == Counts(2, 1)


def test_spare_workers_wait_while_the_other_role_is_busy() -> None:
    """A busy fleet keeps its size: the idle role's workers stay for the next shift; once both roles are
    idle it shrinks."""
    config = replace(CONFIG, scale_down_after=2)
    busy = run([(0.2, 5.0)] * 12, Counts(6, 6), config)
    assert busy[-1].total == 12
    idle = run([(0.2, 0.3)] * 12, Counts(6, 6), config)
    assert idle[-1] == Counts(1, 1)
    # The quiet after chat: one prefill worker hovers about utilization_down. Decode's step down, held while
    # prefill is over it, is taken the first interval prefill dips under; it used to wait for a new low spell,
    # which a busy interval every scale_down_after held off for good.
    hovering = run([(0.3, 0.5), (0.5, 0.5)] * 6, Counts(1, 11), config)
    assert hovering[1] == Counts(1, 11) and hovering[2] == Counts(1, 1), hovering


def test_a_role_that_grows_takes_the_spare_workers_its_load_keeps_busy_in_one_step() -> None:
    """Chat streams build up at 6P6D: decode passes utilization_up at 5 workers' worth, then a burst reads
    7. Decode takes every prefill worker prefill's remembered peak does not need, at once (1P11D): it took
    those its load needed at the target (4P8D), so the burst asked for the rest an interval later."""
    history = run([(0.6, 5.0), (0.6, 7.0)] + [(0.6, 4.5)] * 10, Counts(6, 6))
    assert history[0] == Counts(1, 11) and set(history) == {Counts(1, 11)}, history
    # As far as its load keeps them over utilization_down: 2 workers' worth of prompts keeps 4 prefill workers
    # busy, not the 9 a fleet of one prefill and nine idle decode workers could give it.
    lone = run([(2.0, 0.0)] * 20, Counts(1, 9))
    assert set(lone) == {Counts(4, 6)}, lone


def test_a_bursty_load_keeps_the_workers_its_peaks_need() -> None:
    """A few requests a window make the load swing: a peak now and then (85% of one prefill worker), troughs
    between (30%). The first peak grows the role; the troughs do not take that worker back only for the next
    peak to grow it again."""
    bursty = [(0.85 if i % 6 == 0 else 0.3, 0.2) for i in range(60)]
    prefill = [c.prefill for c in [Counts(1, 1)] + run(bursty, Counts(1, 1))]
    assert prefill[-1] == 2 and sorted(prefill) == prefill, prefill


def test_a_load_that_dropped_for_good_is_scaled_down_once_its_peak_is_forgotten() -> None:
    history = run([(3.0, 0.2)] * 5 + [(0.3, 0.2)] * 30, Counts(1, 1))
    prefill = [c.prefill for c in history]
    assert prefill[4] == 5 and prefill[-1] == 1
    down_at = prefill.index(1)   # the first interval at 1 worker again
    assert down_at >= 5 + PEAK_MEMORY * CONFIG.scale_down_after - 1, prefill
    assert set(prefill[4:down_at]) == {5}, prefill   # in one step


def test_a_shift_that_began_within_the_interval_grows_the_role_by_its_tail() -> None:
    """Documents begin at 2P10D (chat) just before a read: the interval reads prefill at 1.5 workers' worth
    (75%: steady), its second half alone at 4.0 (200%). Prefill grows on the tail now, not an interval
    later; a tail that is no shift (2.4 at 2P, 120%) moves nothing by itself, nor does one while workers
    are on their way to prefill or just joined it."""
    config = replace(CONFIG, min_samples=1)
    chat = figures((1.5, 3.1), Counts(2, 10), config)
    assert not decide(prompts(chat, tail=2.4), Counts(2, 10), PlannerState(), config, 0.0, fixed_fleet=True)[0].changed
    grown, _ = decide(prompts(chat, tail=4.0), Counts(2, 10), PlannerState(), config, 0.0, fixed_fleet=True)
    assert grown.target.prefill >= 7 and "prefill read by the interval's tail" in grown.reason, grown.reason
    # Workers on their way to prefill, or just joined, meet a shift already: a tail past it is a burst of it.
    on_their_way, _ = decide(prompts(chat, tail=4.0), Counts(2, 10), PlannerState(), config, 0.0, fixed_fleet=True,
                             arriving=Counts(1, 0))
    assert "tail" not in on_their_way.reason and on_their_way.target.prefill < grown.target.prefill, on_their_way.reason
    joined, _ = decide(prompts(chat, tail=4.0), Counts(2, 10), PlannerState(arriving_at=(-2.0, None)), config, 0.0,
                       fixed_fleet=True)
    assert "tail" not in joined.reason and joined.target.prefill < grown.target.prefill, joined.reason


def test_a_miss_just_after_workers_joined_the_role_is_the_wait_for_them() -> None:
    """Prefill grew to 10P2D for documents; the decision at 8 s found flips on their way, the one at 10 s
    none. The TTFT percentile still holds documents that waited for them: no worker more for the miss until
    an interval, a window and the TTFT target have passed since 8 s; then the miss counts again."""
    config = replace(CONFIG, min_samples=1, interval_s=2.0)
    start = Counts(10, 2)
    missing = replace(figures((5.5, 0.6), start, config), ttft_s=config.ttft_target_s * 1.01)
    _, state = decide(missing, start, PlannerState(0.0, last_grown="prefill"), config, 8.0, fixed_fleet=True,
                      arriving=Counts(3, 0))
    assert state.arriving_at == (8.0, None)
    joined_by = 8.0 + config.interval_s + config.ttft_target_s + missing.window_s
    held, state = decide(missing, start, state, config, joined_by - 0.1, fixed_fleet=True)
    assert not held.changed and "workers joined lately" in held.reason, held.reason
    queued = replace(missing, prefill=replace(missing.prefill, running=10, waiting=3))   # 13 at 10 workers
    grown, _ = decide(queued, start, state, config, joined_by + 0.1, fixed_fleet=True)
    assert grown.changed and grown.target.prefill == 11 and "TTFT" in grown.reason, grown.reason


def test_a_miss_while_no_request_waits_for_the_roles_workers_is_past() -> None:
    """10P2D at 55% load: the TTFT percentile misses the target on documents that queued before workers joined,
    but its 10 workers run 6 prompts and none waits. A worker more would serve none of them sooner: hold. With
    more prompts at prefill than workers, or jobs in the prefill queue, the miss grows it."""
    config = replace(CONFIG, min_samples=1)
    start = Counts(10, 2)
    missing = replace(figures((5.5, 0.6), start, config), ttft_s=config.ttft_target_s * 1.2)
    idle = replace(missing, prefill=replace(missing.prefill, running=6, waiting=0))
    held, _ = decide(idle, start, PlannerState(), config, 100.0, fixed_fleet=True)
    assert not held.changed and "(nothing waits for its workers): steady" in held.reason, held.reason
    for waiting in (replace(idle, prefill=replace(idle.prefill, waiting=5)), replace(idle, queue_depth=5)):
        grown, _ = decide(waiting, start, PlannerState(), config, 100.0, fixed_fleet=True)
        assert grown.target.prefill == 11 and "TTFT" in grown.reason, grown.reason
