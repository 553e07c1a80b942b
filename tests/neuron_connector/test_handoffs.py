"""Pulls as handoffs, sans I/O: generations through real fence words, quarantine, incarnations."""
from __future__ import annotations

import torch

from neuron_connector.errors import PeerUnavailable
from neuron_connector.incarnation import stale_lookup
from neuron_connector.protocol import STALE_INCARNATION, LookupAll, LookupReply
from neuron_connector.pulls import PullState, PullTracker
from transfer.fences import Fences


def _fenced_tracker() -> tuple[PullTracker, Fences]:
    fences = Fences(torch.zeros(16, dtype=torch.int64))
    return PullTracker(close_blocks=fences.close, reclaim_blocks=fences.reclaim), fences


def test_a_reply_naming_another_handoff_generation_is_dropped_and_counted() -> None:
    tracker, fences = _fenced_tracker()
    tracker.add("r", "p", [4, 5], deadline=30, now=0, generation=9)
    fences.open([4, 5], 9)
    [(_, lookup)] = tracker.due(0, {"p"})
    assert lookup.generation == 9
    tracker.on_reply(LookupReply("r", True, 7, (4, 5), generation=8), now=0.1)   # an older handoff's
    tracker.on_reply(LookupReply("gone", True, 7, (4, 5), generation=3), now=0.1)
    assert tracker.stale_replies == 2 and tracker.poll("r").state is PullState.PENDING and tracker.fenced == 1
    tracker.on_reply(LookupReply("r", True, 7, (4, 5), generation=9), now=0.2)
    assert tracker.poll("r").output_token == 7 and fences.closed()


def test_a_pull_ended_under_its_writer_is_withheld_until_the_writer_lets_go() -> None:
    tracker, fences = _fenced_tracker()
    tracker.add("r", "p", [1, 2], deadline=30, now=0, generation=5)
    fences.open([1, 2], 5)
    tracker.peer_ready("p", "P0", writer=4242)
    tracker.due(0, {"p"})
    assert fences.acquire([1, 2], 5)                      # the peer is writing
    tracker.peer_lost("p")
    assert tracker.take_finished() == [] and tracker.poll("r").state is PullState.PENDING
    assert tracker.cancel("r") is False and tracker.quarantined == 1
    assert tracker.unhold(lambda pid: True) == 1         # alive (frozen): still held
    assert not fences.release([1, 2], 5)                  # it lets go, told it was given up
    assert tracker.unhold(lambda pid: True) == 0 and tracker.take_finished() == ["r"]
    assert isinstance(tracker.poll("r").error, PeerUnavailable) and fences.closed()
    # A writer that dies holding the blocks: they are reclaimed.
    tracker.add("d", "p", [3], deadline=30, now=1, generation=6)
    fences.open([3], 6)
    tracker.due(1, {"p"})
    assert fences.acquire([3], 6)
    tracker.peer_lost("p")
    assert tracker.unhold(lambda pid: pid != 4242) == 0 and tracker.take_finished() == ["d"] and fences.closed()


def test_pulls_asked_of_one_incarnation_fail_when_another_answers_at_the_address() -> None:
    tracker = PullTracker()
    tracker.peer_ready("p", "P0", incarnation="a")
    tracker.add("asked", "p", [0], deadline=30, now=0)
    [(_, lookup)] = tracker.due(0, {"p"})
    assert lookup.incarnation == "a"
    tracker.add("later", "p", [1], deadline=30, now=0)
    tracker.resend_peer("p")                              # "handshake required": the peer is new
    tracker.peer_ready("p", "P0", incarnation="b")        # same engine id, another life
    assert tracker.take_finished() == ["asked"] and tracker.other_incarnation == 1
    assert "restarted (incarnation a, now b)" in tracker.poll("asked").message  # type: ignore[operator]
    [(_, lookup)] = tracker.due(1, {"p"})
    assert lookup.request_id == "later" and lookup.incarnation == "b"


def test_a_prefill_refuses_a_lookup_addressed_to_another_incarnation() -> None:
    lookup = LookupAll("r", (1,), incarnation="old")
    refusal = stale_lookup(lookup, "new", "P0")
    assert refusal is not None and refusal.code == STALE_INCARNATION and refusal.request_id == "r"
    assert stale_lookup(LookupAll("r", (1,), incarnation="new"), "new", "P0") is None
    assert stale_lookup(LookupAll("r", (1,)), "new", "P0") is None    # a peer that names none
    held = stale_lookup(LookupAll("r", (1,)), "new", "P0", "D0", bound="d-old")   # held for D0's old life
    assert held is not None and held.code == STALE_INCARNATION
    assert "incarnation d-old of decode engine 'D0'" in held.message
