"""From the fleet and a target, the changes to make: flips first (a worker keeps its model), then starts and
stops. Pure: a connector carries them out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from planner.figures import OTHER, Counts
from planner.fleet import Fleet, Member


@dataclass(frozen=True, slots=True)
class Action:
    kind: str                  # "flip" | "start" | "stop"
    role: str                  # flip: the role it goes to; start: the new worker's; stop: the one it had
    member: Member | None = None   # flip, stop: which worker

    def __str__(self) -> str:
        if self.kind == "start":
            return f"start a {self.role} worker"
        assert self.member is not None
        if self.kind == "flip":
            return f"flip {self.member.address} {OTHER[self.role]} -> {self.role}"
        return f"stop {self.role} worker {self.member.address}"


def plan(fleet: Fleet, target: Counts, can_flip: bool, in_flight: Mapping[str, float] | None = None) -> list[Action]:
    """The actions that take the fleet's serving members to `target`. The workers moved first are those with
    the fewest requests `in_flight` (by URL), whose drain ends soonest; among equals, the newest-named."""
    current = fleet.counts()
    surplus = {role: current.of(role) - target.of(role) for role in OTHER}
    busy = in_flight or {}
    idle = {role: sorted(sorted(fleet.serving(role), key=lambda m: m.address, reverse=True),
                         key=lambda m: busy.get(m.url, 0.0)) for role in OTHER}
    actions: list[Action] = []
    for role in OTHER:
        if can_flip and surplus[role] > 0 and surplus[OTHER[role]] < 0:
            flips = min(surplus[role], -surplus[OTHER[role]], len(idle[role]))
            actions += [Action("flip", OTHER[role], idle[role].pop(0)) for _ in range(flips)]
            surplus[role] -= flips
            surplus[OTHER[role]] += flips
    for role in OTHER:
        if surplus[role] < 0:
            actions += [Action("start", role) for _ in range(-surplus[role])]
        elif surplus[role] > 0:
            actions += [Action("stop", role, idle[role].pop(0)) for _ in range(min(surplus[role], len(idle[role])))]
    return actions
