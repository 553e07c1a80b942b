"""The prefill side's pullers, driven by hand: which requests a decode engine that lost its session orphans."""
from __future__ import annotations

from neuron_connector.pullers import PROBE_S, Pullers
from neuron_connector.sessions import SessionTable


def test_requests_of_an_engine_lost_past_the_grace_are_orphaned_once() -> None:
    pullers = Pullers(grace=1.0, max_age=60.0)
    pullers.session_up("d1")
    pullers.session_up("d2")
    pullers.expect("a", "d1", now=0)
    pullers.expect("b", "d2", now=0)
    pullers.looked_up("c", "d1", now=0)
    pullers.session_gone("d1", now=10)
    assert pullers.orphans(10.5) == []                     # it may be reconnecting
    assert sorted(pullers.orphans(11)) == [("a", "d1"), ("c", "d1")]
    assert pullers.orphans(12) == []
    pullers.expect("late", "d1", now=12)                   # its prefill leg came after the engine went:
    assert pullers.orphans(20) == []                       # for d1's next life (or the proxy aborts it)
    assert len(pullers) == 2                               # "b": d2 is there


def test_an_engine_back_within_the_grace_keeps_its_requests() -> None:
    pullers = Pullers(grace=1.0, max_age=60.0)
    pullers.session_up("d1")
    pullers.expect("a", "d1", now=0)
    pullers.session_gone("d1", now=1)
    pullers.session_up("d1")
    assert pullers.orphans(5) == [] and len(pullers) == 1


def test_an_engine_never_seen_is_not_lost_and_a_lookup_names_the_real_puller() -> None:
    pullers = Pullers(grace=1.0, max_age=60.0)
    pullers.expect("a", "d1", now=0)
    pullers.session_gone("d1", now=0)                      # never had a session here: not lost
    assert pullers.orphans(5) == []
    pullers.session_up("d1")
    pullers.looked_up("a", "d2", now=5)                    # the decode leg went to another worker
    pullers.session_gone("d1", now=6)
    assert pullers.orphans(10) == []
    pullers.forget(["a"])
    assert len(pullers) == 0


def test_old_expectations_are_forgotten_and_probes_run_only_while_some_wait() -> None:
    pullers = Pullers(grace=1.0, max_age=60.0)
    assert not pullers.probe_due(100)
    pullers.expect("never-published", "d1", now=0)
    assert pullers.probe_due(100) and not pullers.probe_due(100 + PROBE_S / 2) and pullers.probe_due(100 + PROBE_S)
    assert pullers.orphans(100) == [] and len(pullers) == 0


def test_the_session_table_reports_an_engine_unbound_only_when_no_session_holds_it() -> None:
    events: list[tuple[str, str]] = []
    table = SessionTable(lambda engine, incarnation: events.append(("bound", engine)),
                         lambda engine, now: events.append(("unbound", engine)))
    first = table.open(b"r1", "d1", "n1")
    table.establish(first, "peer-1")
    table.open(b"r2", "d1", "n2")             # a second connection, not established: holds nothing
    table.drop(b"r2")
    assert events == [("bound", "d1")]
    table.drop(b"r1")
    assert events == [("bound", "d1"), ("unbound", "d1")]


def test_a_decode_engine_back_as_another_incarnation_orphans_the_old_ones_requests_at_once() -> None:
    pullers = Pullers(grace=1.0, max_age=60.0)
    pullers.session_up("d1", "life-1")
    pullers.expect("old", "d1", now=0)                     # bound to life-1, which had the session
    pullers.looked_up("asked", "d1", now=0, incarnation="life-1")
    pullers.session_gone("d1", now=1)
    pullers.expect("between", "d1", now=1.2)               # no session: bound to whoever asks first
    pullers.session_up("d1", "life-2")                     # back within the grace, as another process
    assert pullers.bound_elsewhere("old", "d1", "life-2") == "life-1"
    assert pullers.bound_elsewhere("between", "d1", "life-2") is None
    assert sorted(pullers.orphans(1.5)) == [("asked", "d1"), ("old", "d1")]
    assert pullers.orphans(5) == [] and len(pullers) == 1  # "between" waits for its lookup
    pullers.session_up("d1", "life-2")                     # the same life reconnecting orphans nothing
    pullers.expect("new", "d1", now=6)
    pullers.session_up("d1", "life-2")
    assert pullers.orphans(7) == [] and pullers.bound_elsewhere("new", "d1", "life-2") is None


def test_a_request_named_for_a_lost_engine_waits_for_its_next_life() -> None:
    """A decode worker that changed role and back: its old session went long ago, and a request named for
    it now is for its new life, whose session comes with its first lookup."""
    pullers = Pullers(grace=1.0, max_age=60.0)
    pullers.session_up("d1", "life-1")
    pullers.expect("before", "d1", now=0)
    pullers.session_gone("d1", now=1)
    assert pullers.orphans(2.5) == [("before", "d1")]
    pullers.expect("after", "d1", now=30)
    assert pullers.orphans(35) == [] and pullers.bound_elsewhere("after", "d1", "life-2") is None
    pullers.session_up("d1", "life-2")
    pullers.looked_up("after", "d1", now=35.1, incarnation="life-2")
    assert pullers.orphans(36) == [] and len(pullers) == 1


def test_a_request_held_for_one_engine_may_be_looked_up_by_another() -> None:
    """The decode leg went elsewhere (the engine the prefill leg named was draining and refused it): the
    other engine pulls it; only another life of the named engine is refused."""
    pullers = Pullers(grace=1.0, max_age=60.0)
    pullers.session_up("d1", "d1-life")
    pullers.session_up("d2", "d2-life")
    pullers.expect("r", "d1", now=0)
    assert pullers.bound_elsewhere("r", "d2", "d2-life") is None
    assert pullers.bound_elsewhere("r", "d1", "d1-next") == "d1-life"
    pullers.looked_up("r", "d2", now=0.1, incarnation="d2-life")
    assert pullers.bound_elsewhere("r", "d2", "d2-life") is None and pullers.orphans(5) == []
