"""The decision: figures in, target counts of prefill and decode workers out. Pure: no I/O, no clock.

Each role's load is how many workers' worth of capacity its demand needs (prefill: prompt tokens per
second, over the window or its last interval if that is more, over the measured prefill speed; decode:
tokens per second, produced or asked for by the requests received (over the window or its last interval),
over what one worker yields at the ITL target, or the streams in flight over the batch that keeps the step
time at it). Boring on purpose:
- up at once when utilization passes `utilization_up` (or the SLO is missed and the load explains it, which
  it does not while workers are on their way to the role, nor for an interval, a window and the role's
  target after they joined it: the miss is the wait for them; nor while no request waits for the role's
  workers, or on decode no batch is past the one that keeps the ITL target: more workers would serve none
  sooner), to `utilization_target`; never on fewer than
  `min_samples` requests unless the load exceeds the role's capacity outright (a saturated role delays the
  very first tokens the samples count). A shift that began within the interval shows first in its tail (the
  demand since the observer's read mid-way): a role whose tail alone is past SHIFT times its workers'
  capacity, with none on their way to it or just joined, is read by the tail;
- down only after `scale_down_after` intervals in a row under `utilization_down`, to what the highest load
  of the last PEAK_MEMORY * `scale_down_after` intervals needs at `utilization_target`, and in one step: while
  a higher load from before the low spell is still remembered, the step waits for it to be forgotten. The
  band between the two thresholds absorbs a steady load's noise, and the peak a bursty load (a few requests
  a window) hits between its troughs keeps the workers it would otherwise grow back to; the fleet shrinks
  only once every role is under it (till then a role's spare workers wait for the other, and their step down
  stays due: it is taken the first interval the other dips under, not after a new low spell);
- no step down within `cooldown_s` of the last change, unless it makes room for the role that grew last
  and still asks for more (past `utilization_up`, or an SLO miss its load explains: a shift not yet met);
  so a count never turns back within the cool-down; nothing without figures;
- each role within its bounds, both within the budget: a role that grows takes the other's spare workers
  (short of those the other needs at `utilization_target`; in a fleet that keeps its size, those its
  remembered peak needs, and only as many as its own load keeps over `utilization_down`: the rest would wait
  there for its next step), and needs past the budget split it in proportion to the loads; a split at the
  budget moves only when the proportion has moved by more than HOLD_SPLIT workers. In a shift (a role's load
  past SHIFT times its workers' capacity), the other role gives up workers by its last interval's load, or
  that interval's tail's, where that is lower: its window's mean lags a fall as it lags a rise, and the
  interval may hold demand from before the shift; and a split rounds toward the role the traffic shifts to.
  Past the budget without a shift (a burst), the role that needs fewer workers to stay under `utilization_up`
  keeps those of them it has: taken, they would only be asked back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from planner.config import PlannerConfig
from planner.figures import OTHER, Counts, Figures, RoleFigures

ROLES = ("prefill", "decode")
HOLD_SPLIT = 1.5   # workers: a split at the budget follows the loads' proportion only past this distance
PEAK_MEMORY = 3    # scale-down streaks: a step down serves the highest load of this many streaks' intervals
SHIFT = 1.5        # a role's load past this many times its workers' capacity is a shift in the traffic, not a
                   # burst (bursts of a steady phase reach 1.15 in benchmarks/results/planner_phase_change.json)


@dataclass(frozen=True, slots=True)
class PlannerState:
    """What the decision remembers between intervals."""

    last_change_at: float | None = None
    low_streak: tuple[int, int] = (0, 0)   # prefill, decode: intervals in a row under utilization_down
    last_grown: str | None = None          # the role the last change grew, if it grew one role only
    recent_loads: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())   # prefill, decode: the last
                                           # PEAK_MEMORY * scale_down_after intervals' loads, oldest first
    arriving_at: tuple[float | None, float | None] = (None, None)   # prefill, decode: the last decision that
                                           # found workers on their way to the role


@dataclass(frozen=True, slots=True)
class Decision:
    target: Counts
    changed: bool
    reason: str
    loads: dict[str, float] = field(default_factory=dict)


def decide(figures: Figures | None, current: Counts, state: PlannerState, config: PlannerConfig,
           now: float, missing: str = "no figures", fixed_fleet: bool = False,
           arriving: Counts = Counts(0, 0)) -> tuple[Decision, PlannerState]:
    """The target counts for `current` given the interval's `figures` (None: hold, because `missing`).
    A `fixed_fleet` (workers flip, none start or stop) keeps its total: only the split moves. `arriving`:
    the workers of `current` still on their way to each role (flipping or starting), which serve nothing yet."""
    if figures is None:
        return Decision(current, False, f"hold: {missing}"), state
    loads = {role: load(role, figures, config) for role in ROLES}
    arriving_at = (now if arriving.prefill else state.arriving_at[0], now if arriving.decode else state.arriving_at[1])
    joined = {role: _joined(arriving_at[i], role, figures, config, now) for i, role in enumerate(ROLES)}
    # A shift that began within the interval: its tail alone is past SHIFT times the role's capacity, an
    # interval before the interval's own rate shows it (a tail too short to tell a burst from a shift by less).
    # While workers are on their way to the role, or just joined it, a shift is being met: a tail is its burst.
    tails = {role: tail_load(role, figures, config) or 0.0 for role in ROLES}
    rising = [role for role in ROLES if not arriving.of(role) and not joined[role]
              and tails[role] > max(loads[role], SHIFT * current.of(role))]
    loads.update({role: tails[role] for role in rising})
    memory = PEAK_MEMORY * config.scale_down_after
    recent = tuple((*state.recent_loads[i], loads[role])[-memory:] for i, role in enumerate(ROLES))
    cooling = state.last_change_at is not None and now - state.last_change_at < config.cooldown_s
    wanted: dict[str, int] = {}
    streaks: list[int] = []
    reasons: list[str] = []
    for i, role in enumerate(ROLES):
        count, streak, why = _role_target(role, loads[role], recent[i], _pressure(role, figures, config),
                                          current.of(role), arriving.of(role), joined[role],
                                          _waits(role, figures, config), state.low_streak[i],
                                          figures.samples >= config.min_samples, config)
        wanted[role], reasons = count, reasons + [f"{role} {why}"]
        streaks.append(streak)
    shares = _budget_loads(loads, figures, current, config)
    reasons += [f"{role} gives by its latest load {shares[role]:.2f}" for role in ROLES
                if shares[role] < loads[role]]
    reasons += [f"{role} read by the interval's tail" for role in rising]
    # What each role needs: a growing role what it asked for (an SLO miss may ask one more than its load).
    needs = {role: max(_need(role, shares[role], config), wanted[role] if wanted[role] > current.of(role) else 0)
             for role in ROLES}
    target = _within_budget(wanted, needs, shares, current, config)
    busy = any(loads[role] / max(current.of(role), 1) >= config.utilization_down for role in ROLES)
    if fixed_fleet or (busy and target.total < current.total):   # spare workers stay while any role is busy
        kept = {role: _need(role, max(recent[i]), config) for i, role in enumerate(ROLES)}
        target = _same_total(target, shares, current, config, kept)
    shrinks = target.prefill < current.prefill or target.decode < current.decode
    if cooling and shrinks and not _keeps_growing(target, current, state, wanted):
        left = config.cooldown_s - (now - state.last_change_at)   # type: ignore[operator]
        return Decision(current, False, f"hold: cooling down ({left:.0f} s left)", loads), replace(
            state, recent_loads=recent, arriving_at=arriving_at)
    changed = target != current
    if changed:
        grown = [role for role in ROLES if target.of(role) > current.of(role)]
        new_state = PlannerState(now, (0, 0), grown[0] if len(grown) == 1 else None, recent, arriving_at)
    else:
        new_state = PlannerState(state.last_change_at, (streaks[0], streaks[1]), state.last_grown, recent,
                                 arriving_at)
    verb = f"{current} -> {target}" if changed else f"hold {current}"
    return Decision(target, changed, f"{verb}: {'; '.join(reasons)}", loads), new_state


def _keeps_growing(target: Counts, current: Counts, state: PlannerState, wanted: dict[str, int]) -> bool:
    """Whether `target` grows again only the role the last change grew, whose own rule still asks for more
    (its load past utilization_up, or an SLO miss its load explains)."""
    role = state.last_grown
    if role is None:
        return False
    other = OTHER[role]
    grows_alone = target.of(role) > current.of(role) and target.of(other) <= current.of(other)
    return grows_alone and wanted[role] > current.of(role)


def load(role: str, figures: Figures, config: PlannerConfig, latest: bool = False) -> float:
    """Workers' worth of `role` the demand needs, each at 100% utilization: the window's mean, or its last
    interval's if that is more; `latest`: the last interval's, or its tail's (since the observer sampled it)
    where that is lower, where the workers count them."""
    own = figures.role(role)
    if role == "prefill":
        # The window's mean smooths noise but lags a shift by half the window; the last interval alone shows it.
        return _demand(own.prompt_tokens_per_s, own.latest_prompt_tokens_per_s, own.tail_prompt_tokens_per_s,
                       latest) / _worker_rate(role, own, config)
    batch, tokens_per_s = decode_capacity(own, config)
    # Tokens produced lag behind a growing demand, and the streams in flight build up over a generation's
    # length; the tokens the requests received ask for show it as they arrive.
    demand = _demand(max(own.generated_tokens_per_s, own.requested_tokens_per_s or 0.0),
                     own.latest_requested_tokens_per_s, own.tail_requested_tokens_per_s, latest)
    return max(demand / tokens_per_s, (own.running + own.waiting) / batch)


def tail_load(role: str, figures: Figures, config: PlannerConfig) -> float | None:
    """Workers' worth of `role` the demand of the last interval's tail alone needs (None: not read)."""
    own = figures.role(role)
    tail = own.tail_prompt_tokens_per_s if role == "prefill" else own.tail_requested_tokens_per_s
    return None if tail is None else tail / _worker_rate(role, own, config)


def _worker_rate(role: str, own: RoleFigures, config: PlannerConfig) -> float:
    """What one worker of `role` serves a second: prompt tokens (measured, or the profile's), or output
    tokens at the ITL target."""
    if role == "prefill":
        return own.prefill_tokens_per_busy_s or config.prefill_tokens_per_s
    return decode_capacity(own, config)[1]


def _demand(window: float, interval: float | None, tail: float | None, latest: bool) -> float:
    """The demand (see load) from its rates over the window, the last interval and that interval's tail."""
    recent = [rate for rate in (interval, tail) if rate is not None]
    if latest and recent:
        return min(recent)
    return max(window, interval or 0.0)


def _budget_loads(loads: dict[str, float], figures: Figures, current: Counts,
                  config: PlannerConfig) -> dict[str, float]:
    """The loads the budget is divided by: `loads`, but in a shift (see _shifted), the other role's load over
    its last interval alone, or that interval's tail, where that is lower, so that it gives up in one step
    the workers its fallen demand no longer needs (the interval may still hold demand from before the shift)."""
    shares = dict(loads)
    for role in ROLES:
        other = OTHER[role]
        if _shifted(role, loads, current) and loads[other] <= config.utilization_up * current.of(other):
            shares[other] = min(loads[other], load(other, figures, config, latest=True))
    return shares


def _shifted(role: str, loads: dict[str, float], current: Counts) -> bool:
    """Whether `role`'s load is past SHIFT times its workers' capacity: the traffic shifted its way."""
    return loads[role] > SHIFT * current.of(role)


def decode_capacity(figures: RoleFigures, config: PlannerConfig) -> tuple[float, float]:
    """(Batch, tokens per second) of one decode worker with its token gap at the ITL target: the step
    time's slope from the profile; its intercept the profile's, or the one measured where the workers
    decoded if that is longer (the profile's may include what a step alone does not: the time between
    steps, the proxy)."""
    slope, base = config.decode_per_seq_s, config.decode_base_s
    if figures.decode_step_s is not None and figures.decode_batch:
        base = max(figures.decode_step_s - slope * figures.decode_batch, base)
    batch = config.max_batch if slope <= 0 else (config.itl_target_s - base) / slope
    batch = min(max(batch, 1.0), float(config.max_batch))
    return batch, batch / (base + slope * batch)


def _pressure(role: str, figures: Figures, config: PlannerConfig) -> str | None:
    """Why `role` misses its SLO now (its percentile over the target, a full KV pool, a long queue), or None."""
    if role == "prefill":
        if figures.ttft_s is not None and figures.ttft_s > config.ttft_target_s:
            return f"TTFT p{config.percentile * 100:g} {figures.ttft_s:.2f} s > {config.ttft_target_s:g} s"
        if figures.queue_wait_s is not None and figures.queue_wait_s > config.ttft_target_s:
            return f"prefill queue wait {figures.queue_wait_s:.2f} s > {config.ttft_target_s:g} s"
        return None
    if figures.itl_s is not None and figures.itl_s > config.itl_target_s:
        return f"ITL p{config.percentile * 100:g} {figures.itl_s * 1000:.0f} ms > {config.itl_target_s * 1000:g} ms"
    if figures.decode.kv_used_fraction > config.kv_high:
        return f"KV {figures.decode.kv_used_fraction:.0%} used"
    return None


def _waits(role: str, figures: Figures, config: PlannerConfig) -> bool:
    """Whether requests wait for `role`'s workers now, so that more of them would serve sooner: on prefill, more
    requests at its workers (and in the prefill queue) than workers; on decode, streams queued, or batches past
    the one whose step keeps the ITL target (under it, a smaller batch would not bring a token sooner: a miss
    then is a stream's first gap, its KV's pull, not the step)."""
    own = figures.role(role)
    if role == "decode":
        return own.waiting > 0 or own.running > decode_capacity(own, config)[0] * own.workers
    return own.running + own.waiting + (figures.queue_depth or 0) > own.workers


def _joined(arriving_at: float | None, role: str, figures: Figures, config: PlannerConfig, now: float) -> bool:
    """Whether workers on their way to `role` joined it so lately (by the decision after `arriving_at`) that
    the interval's percentile may still hold requests that waited for them: their first tokens come up to the
    role's target after, and the window keeps them that long again."""
    if arriving_at is None or arriving_at == now:
        return False
    target = config.ttft_target_s if role == "prefill" else config.itl_target_s
    return now - arriving_at < config.interval_s + target + figures.window_s


def _role_target(role: str, role_load: float, recent: tuple[float, ...], pressure: str | None, count: int,
                 arriving: int, joined: bool, waits: bool, streak: int, enough: bool,
                 config: PlannerConfig) -> tuple[int, int, str]:
    """(workers wanted, intervals under utilization_down so far, why) for one role of `count` workers, `arriving`
    of them still on their way to it (`joined`: others joined it lately, see _joined; `waits`: requests wait for
    its workers now, see _waits); `recent` are its loads remembered (see PEAK_MEMORY), this interval's last:
    their peak is what a step down must still serve."""
    low, high = config.bounds(role)
    to_target = _need(role, role_load, config)
    utilization = role_load / count if count else math.inf
    described = f"load {role_load:.2f} ({utilization:.0%} of {count})"
    if count < low:
        return to_target, 0, f"{described}: below its minimum"
    # A miss the load explains: one more worker would not bring it under utilization_down. While workers are
    # on their way to the role, or just joined it, a miss is the wait for them: only the load grows it further.
    # Nor is a miss while no request waits for its workers (see _waits): more of them would serve none sooner.
    explained = (pressure is not None and not arriving and not joined and waits
                 and role_load / (count + 1) >= config.utilization_down)
    if utilization > config.utilization_up or explained:
        if not enough and utilization < 1.0:   # past full capacity, the counters say enough
            return count, 0, f"{described}: too few samples to scale up"
        # A miss the load explains grows the role by half (at least one), as far as the load keeps the new
        # workers over utilization_down: a steady load never takes them back.
        jump = max(count + 1, min(math.ceil(count * 1.5), math.floor(role_load / config.utilization_down)))
        wanted = min(max(to_target, jump if explained else to_target), high)
        return wanted, 0, f"{described}{f', {pressure}' if explained else ''}: up"
    if utilization < config.utilization_down and to_target < count and pressure is None:
        if streak + 1 < config.scale_down_after:
            return count, streak + 1, f"{described}: low for {streak + 1} of {config.scale_down_after} intervals"
        peak, low_peak = max(recent), max(recent[-(streak + 1):])   # remembered; within the low spell
        down_to = _need(role, peak, config)
        if down_to >= count:
            return count, streak + 1, f"{described}: low, but a recent load of {peak:.2f} needs {count}"
        if down_to > _need(role, low_peak, config):
            return count, streak + 1, f"{described}: low; down once a load of {peak:.2f} from before is forgotten"
        return down_to, streak + 1, f"{described}, recent peak {peak:.2f}: down"   # held, it stays due
    why = (f"{arriving} on their way" if arriving else "workers joined lately" if joined
           else "nothing waits for its workers" if not waits else "not explained by load")
    return count, 0, f"{described}{f', {pressure} ({why})' if pressure else ''}: steady"


def _need(role: str, role_load: float, config: PlannerConfig) -> int:
    """Workers that run `role_load` at utilization_target, within the role's bounds."""
    low, high = config.bounds(role)
    return min(max(math.ceil(role_load / config.utilization_target), low), high)


def _within_budget(wanted: dict[str, int], needs: dict[str, int], loads: dict[str, float], current: Counts,
                   config: PlannerConfig) -> Counts:
    """`wanted`; or when it exceeds the budget, the needs if they fit, else a split of the budget in
    proportion to the loads (held where it is when that is at the budget and near the proportion)."""
    target = Counts(wanted["prefill"], wanted["decode"])
    if target.total <= config.budget:
        return _leave_room(target, loads, current, config)
    if needs["prefill"] + needs["decode"] <= config.budget:   # the growing role takes the other's spare workers
        return Counts(needs["prefill"], needs["decode"])
    return _split(config.budget, loads, current, config)


def _leave_room(target: Counts, loads: dict[str, float], current: Counts, config: PlannerConfig) -> Counts:
    """`target` with a growing role stopped short of the budget's workers the other role needs at
    utilization_target (a steady role over it asks for them as soon as its load ticks past utilization_up,
    and would take them back), though never below what keeps the growing role itself under utilization_up."""
    for role in ROLES:
        if target.of(role) > current.of(role):
            other = OTHER[role]
            room = config.budget - max(target.of(other), _need(other, loads[other], config))
            enough = min(math.ceil(loads[role] / config.utilization_up), target.of(role))
            count = min(target.of(role), max(room, enough, current.of(role) + 1))
            target = Counts(count, target.decode) if role == "prefill" else Counts(target.prefill, count)
    return target


def _split(total: int, loads: dict[str, float], current: Counts, config: PlannerConfig) -> Counts:
    """`total` workers in proportion to the loads (rounded toward the role a shift goes to), each role within
    its bounds and, where `total` allows it, with enough workers to keep it under utilization_up (a small role
    rounded away by the proportion would ask for its worker back at once); where it does not, and no role's
    load is a shift (a burst), the role that needs fewer such workers keeps those of them it has; `current`
    if it has that total and is within HOLD_SPLIT of that."""
    (low_p, high_p), (low_d, high_d) = config.bounds("prefill"), config.bounds("decode")
    ideal = total * loads["prefill"] / ((loads["prefill"] + loads["decode"]) or 1.0)
    enough_p, enough_d = (math.ceil(loads[role] / config.utilization_up) for role in ROLES)
    if enough_p + enough_d <= total:
        ideal = min(max(ideal, enough_p), total - enough_d)
    elif not any(_shifted(role, loads, current) for role in ROLES):   # a burst: the role that fits keeps its own
        ideal = (min(ideal, total - min(enough_d, current.decode)) if enough_d < enough_p
                 else max(ideal, min(enough_p, current.prefill)))
    ideal = min(max(ideal, low_p, total - high_d), high_p, total - low_d)
    if current.total == total and abs(ideal - current.prefill) <= HOLD_SPLIT:
        return current
    # In a shift the proportion is taken mid-way (the giving role's load lags its fall, the other's its rise):
    # its fraction of a worker goes to the role the traffic shifts to.
    toward = [role for role in ROLES if _shifted(role, loads, current)]
    prefill = (math.ceil(ideal) if toward == ["prefill"] else math.floor(ideal) if toward == ["decode"]
               else round(ideal))
    return Counts(prefill, total - prefill)


def _same_total(target: Counts, loads: dict[str, float], current: Counts, config: PlannerConfig,
                kept: dict[str, int]) -> Counts:
    """`target` with `current`'s total: a role that grows takes workers from the other, and with them those
    the other's target gives up past what its remembered peak needs (`kept`), as far as its load keeps them
    over utilization_down (so that it never gives them back unasked), which would otherwise wait there for
    the grown role's next step; the split of a fleet too small for both needs follows the loads; with no
    role growing, spare workers stay where they are."""
    grows = [role for role in ROLES if target.of(role) > current.of(role)]
    if target.total > current.total or len(grows) == 2:
        return _split(current.total, loads, current, config)
    if not grows:
        return current
    role, other = grows[0], OTHER[grows[0]]
    spare = min(current.total - max(target.of(other), kept[other]), math.floor(loads[role] / config.utilization_down))
    count = min(max(target.of(role), spare), current.total - config.bounds(other)[0], config.bounds(role)[1])
    return Counts(count, current.total - count) if role == "prefill" else Counts(current.total - count, count)
