"""Every interval: follow the changes under way, read the fleet and its figures, decide, act, log."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from planner import state as saved
from planner.actions import plan
from planner.config import PlannerConfig
from planner.connectors import Connector
from planner.decide import Decision, PlannerState, decide
from planner.errors import PlannerError
from planner.fleet import Member
from planner.observe import Observer

log = logging.getLogger("planner")


class Planner:
    """Decides and acts once per `config.interval_s`; `state_file` keeps its memory across restarts and
    `decisions` (JSON lines) records every interval's decision and fleet."""

    def __init__(self, config: PlannerConfig, connector: Connector, observer: Observer,
                 state_file: Path | None = None, decisions: Path | None = None) -> None:
        self.config, self.connector, self.observer = config, connector, observer
        self.state_file, self.decisions = state_file, decisions
        self.state = PlannerState()
        self.serving: list[Member] = []   # the workers serving at the last interval, read again mid-way
        if state_file is not None:
            self.state, flips, starts = saved.load(state_file)
            connector.restore(flips, starts)
            if flips or starts or self.state.last_change_at:
                log.info("took over from the state file %s: %d flips and %d starts under way", state_file,
                         len(flips), len(starts))

    async def step(self) -> Decision:
        await self.connector.progress()
        fleet = await self.connector.fleet()
        self.serving = fleet.serving()
        figures, why = await self.observer.figures(self.serving)
        # Changes under way count as done (a stopping worker no more), so none is made twice; only serving
        # workers are flipped or stopped.
        decision, self.state = decide(figures, fleet.counts(), self.state, self.config, time.time(), why,
                                      fixed_fleet=not self.connector.can_scale, arriving=fleet.arriving())
        if fleet.changing:
            decision = replace(decision, reason=decision.reason + "; under way: " + ", ".join(
                f"{m.address} {m.state} ({m.role})" for m in fleet.changing))
        (log.info if decision.changed else log.debug)("%s", decision.reason)
        if decision.changed:
            actions = plan(fleet, decision.target, self.connector.can_flip, self.observer.in_flight)
            log.info("acting: %s", "; ".join(map(str, actions)))
            await self.connector.apply(actions)
        self._record(decision, fleet.counts(), figures is not None)
        return decision

    async def run(self) -> None:
        """Forever; an interval that fails (etcd or a worker unreachable, a connector refused) is logged and
        the next one tries again. Mid-way through each interval the observer samples the pages, so that the
        next decision also sees the demand of the interval's second half alone."""
        next_at = time.monotonic()
        while True:
            try:
                await self.step()
            except PlannerError as exc:
                log.warning("interval failed, no action: %s", exc)
            next_at += self.config.interval_s
            await asyncio.sleep(max(0.0, next_at - self.config.interval_s / 2 - time.monotonic()))
            await self.observer.sample(self.serving)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    def _record(self, decision: Decision, counts: Any, has_figures: bool) -> None:
        if self.state_file is not None:
            saved.save(self.state_file, self.state, *self.connector.under_way())
        if self.decisions is not None:
            line = {"at": time.time(), "prefill": counts.prefill, "decode": counts.decode,
                    "target_prefill": decision.target.prefill, "target_decode": decision.target.decode,
                    "changed": decision.changed, "figures": has_figures, "reason": decision.reason,
                    "loads": {role: round(value, 3) for role, value in decision.loads.items()}}
            with self.decisions.open("a") as out:
                out.write(json.dumps(line) + "\n")
