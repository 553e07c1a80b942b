"""What survives a restart of the planner (`--state-file`): the decision's memory, and the flips and starts
under way, so a planner started again counts them and keeps its cool-down instead of acting twice."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

from planner.connectors.flip import Flip
from planner.connectors.local import Start
from planner.decide import PlannerState
from planner.fleet import Member

log = logging.getLogger("planner.state")


def save(path: Path, state: PlannerState, flips: list[Flip], starts: list[Start]) -> None:
    """Writes atomically (a new file renamed over the old one)."""
    data = {"last_change_at": state.last_change_at, "low_streak": list(state.low_streak),
            "last_grown": state.last_grown, "recent_loads": [list(loads) for loads in state.recent_loads],
            "arriving_at": list(state.arriving_at),
            "flips": [{**asdict(f.member), "deadline": f.deadline} for f in flips],
            "starts": [{**asdict(s.member), "pid": s.pid, "deadline": s.deadline, "log_path": s.log_path}
                       for s in starts]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def load(path: Path) -> tuple[PlannerState, list[Flip], list[Start]]:
    """The saved state; a fresh one when the file is missing or unreadable (logged)."""
    try:
        data = json.loads(path.read_text())
        member = lambda d: Member(d["address"], d["role"], d["state"])   # noqa: E731
        recent = data.get("recent_loads", [[], []])
        return (PlannerState(data["last_change_at"], tuple(data["low_streak"]), data.get("last_grown"),
                             (tuple(recent[0]), tuple(recent[1])), tuple(data.get("arriving_at", (None, None)))),
                [Flip(member(d), d["deadline"]) for d in data["flips"]],
                [Start(member(d), d["pid"], d["deadline"], d["log_path"]) for d in data["starts"]])
    except FileNotFoundError:
        return PlannerState(), [], []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring the state file %s: %s", path, exc)
        return PlannerState(), [], []
