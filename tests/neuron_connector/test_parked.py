"""Held lookups, sans I/O: answered once their request is ready, or "not ready" after the hold."""
from __future__ import annotations

from neuron_connector.parked import ParkedLookups


def test_a_held_lookup_is_taken_when_ready_or_after_its_hold() -> None:
    parked: ParkedLookups[str] = ParkedLookups(hold=0.5)
    parked.park("a", b"peer", "lookup a", now=10.0, wait_left=None)
    parked.park("b", b"peer", "lookup b", now=10.0, wait_left=0.2)   # the peer waits 0.2 s more: held 0.1
    assert parked.take(lambda rid: False, now=10.05) == ([], [])
    assert parked.next_due(10.05) is not None and abs(parked.next_due(10.05) - 0.05) < 1e-9
    ready, expired = parked.take(lambda rid: False, now=10.1)
    assert ready == [] and [p.message for p in expired] == ["lookup b"]
    ready, expired = parked.take(lambda rid: rid == "a", now=10.2)
    assert [p.message for p in ready] == ["lookup a"] and expired == [] and len(parked) == 0


def test_a_newer_lookup_of_a_request_replaces_the_held_one() -> None:
    parked: ParkedLookups[str] = ParkedLookups()
    parked.park("a", b"old", "first", now=0.0, wait_left=None)
    parked.park("a", b"new", "second", now=0.1, wait_left=None)
    ready, _ = parked.take(lambda rid: True, now=0.2)
    assert [(p.identity, p.message) for p in ready] == [(b"new", "second")]
