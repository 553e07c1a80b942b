"""From a fleet and a target, the actions: flips before starts and stops, the least busy workers first."""
from __future__ import annotations

from planner.actions import Action, plan
from planner.figures import Counts
from planner.fleet import Fleet, Member

FLEET = Fleet((Member("p:1", "prefill"), Member("d:1", "decode"), Member("d:2", "decode"), Member("d:3", "decode")))


def test_the_decode_workers_with_the_fewest_requests_in_flight_flip_first() -> None:
    in_flight = {"http://d:1": 0.0, "http://d:2": 9.0, "http://d:3": 4.0}
    actions = plan(FLEET, Counts(3, 1), can_flip=True, in_flight=in_flight)
    assert actions == [Action("flip", "prefill", Member("d:1", "decode")), Action("flip", "prefill", Member("d:3", "decode"))]


def test_without_figures_the_newest_named_move_first_and_a_fleet_that_cannot_flip_starts_and_stops() -> None:
    assert plan(FLEET, Counts(2, 2), can_flip=True) == [Action("flip", "prefill", Member("d:3", "decode"))]
    assert plan(FLEET, Counts(2, 2), can_flip=False) == [Action("start", "prefill"),
                                                          Action("stop", "decode", Member("d:3", "decode"))]
