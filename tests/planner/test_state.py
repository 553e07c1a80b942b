"""The planner's state file: what the decision remembers comes back as it was saved."""
from __future__ import annotations

from pathlib import Path

from planner import state
from planner.decide import PlannerState


def test_the_decisions_memory_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "planner-state.json"
    saved = PlannerState(12.5, (2, 0), "decode", ((0.4, 0.9), (3.0, 2.5, 2.75)), (10.5, None))
    state.save(path, saved, [], [])
    assert state.load(path) == (saved, [], [])


def test_a_state_file_of_an_older_planner_loads_without_its_recent_loads(tmp_path: Path) -> None:
    path = tmp_path / "planner-state.json"
    path.write_text('{"last_change_at": 1.0, "low_streak": [1, 2], "last_grown": null, "flips": [], "starts": []}')
    assert state.load(path) == (PlannerState(1.0, (1, 2), None), [], [])
