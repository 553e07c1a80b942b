"""The sans-I/O halves: the prefill lookup table and decode pulls, driven by hand."""
from __future__ import annotations

import pytest

from neuron_connector.errors import (
    DuplicateRequest, EngineMismatch, HandshakeError, LayoutMismatch, PeerUnavailable, ProtocolError, PullTimeout,
    UnknownRequest)
from neuron_connector.lookup import Answer, InProgress, LookupTable, NotReady, Start
from neuron_connector.protocol import LookupAll, LookupReply, Release
from neuron_connector.pulls import PullState, PullTracker

D1, D2 = b"127.0.0.1:8200", b"127.0.0.1:8201"


class TestLookupTable:
    def test_publish_lookup_transfer_release(self) -> None:
        table = LookupTable(abort_timeout=10)
        assert table.lookup("r", D1, (0,)) == NotReady()
        table.publish("r", [4, 5], 99, now=0)
        assert table.lookup("r", D1, (7, 8)) == Start((4, 5), (7, 8))
        assert table.lookup("r", D1, (7, 8)) == InProgress()          # a resent lookup
        assert table.take_releases() == []
        peer, reply = table.transfer_done("r", None, now=1)
        assert peer == D1 and reply == LookupReply("r", True, 99, (7, 8))
        assert table.take_releases() == ["r"] and table.take_releases() == []
        # A lost reply is answered again, identically, to the same peer only.
        assert table.lookup("r", D1, (7, 8)) == Answer(reply)
        assert "another peer" in table.lookup("r", D2, (7, 8)).reply.error  # type: ignore[union-attr]

    def test_duplicate_publish_leaves_the_entry_alone(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("r", [1], 5, now=0)
        with pytest.raises(DuplicateRequest):
            table.publish("r", [2, 3], 6, now=0)
        assert table.lookup("r", D1, (9,)) == Start((1,), (9,))

    def test_expiry_releases_only_unpulled_entries(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("idle", [1], 5, now=0)
        table.publish("busy", [2], 6, now=0)
        table.lookup("busy", D1, (3,))
        table.expire(now=10)
        assert table.take_releases() == ["idle"] and table.pending() == 1
        assert "not pulled within" in table.lookup("idle", D1, (1,)).reply.error  # type: ignore[union-attr]
        table.expire(now=21)                  # the tombstone is forgotten after abort_timeout
        assert table.lookup("idle", D1, (1,)) == NotReady()

    def test_discard_while_transferring_releases_after_the_transfer(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("r", [1], 5, now=0)
        table.lookup("r", D1, (3,))
        table.discard("r", now=1)
        assert table.take_releases() == []
        _, reply = table.transfer_done("r", None, now=2)
        assert not reply.success and "aborted" in reply.error  # type: ignore[operator]
        assert table.take_releases() == ["r"]

    def test_failed_transfer_and_short_block_list_are_terminal(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("r", [1, 2], 5, now=0)
        assert "offered 3" in table.lookup("r", D1, (3, 4, 5)).reply.error  # type: ignore[union-attr]
        table.lookup("r", D1, (3, 4))
        _, reply = table.transfer_done("r", "peer lost", now=1)
        assert reply == LookupReply("r", False, error="peer lost")
        assert table.take_releases() == ["r"]

    def test_fewer_peer_blocks_take_the_tail(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("r", [4, 5, 6], 5, now=0)
        assert table.lookup("r", D1, (9,)) == Start((6,), (9,))
        table.publish("s", [7], 5, now=0)
        assert table.lookup("s", D1, ()) == Start((), ())

    def test_a_peer_naming_its_cached_blocks_gets_exactly_the_rest(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("r", [4, 5, 6, 7], 5, now=0)
        assert table.lookup("r", D1, (9,), skipped=3) == Start((7,), (9,))
        table.publish("s", [4, 5, 6], 5, now=0)
        refused = table.lookup("s", D1, (9,), skipped=1)
        assert isinstance(refused, Answer) and "holds 3 blocks, peer holds 1 and offered 1" in refused.reply.error
        table.publish("t", [4, 5], 5, now=0)
        assert table.lookup("t", D1, (8, 9), skipped=0) == Start((4, 5), (8, 9))

    def test_release_of_an_unpulled_request_frees_it_at_once(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("r", [1, 2], 5, now=0)
        assert table.release("r", D1, now=1) is True
        assert table.take_releases() == ["r"] and table.pending() == 0
        # Any later lookup fails at once; a repeated release frees nothing twice.
        assert "released by its decode peer" in table.lookup("r", D2, (3,)).reply.error  # type: ignore[union-attr]
        assert table.release("r", D1, now=2) is True and table.take_releases() == []

    def test_release_before_publish_frees_the_blocks_at_publish(self) -> None:
        table = LookupTable(abort_timeout=10)
        assert table.release("r", D1, now=0) is True
        assert table.take_releases() == [] and not table.known("r")   # its prefill leg may still come
        assert "released" in table.lookup("r", D1, (3,)).reply.error  # type: ignore[union-attr]
        assert table.publish("r", [1, 2], 5, now=1) is False
        assert table.take_releases() == ["r"] and table.pending() == 0
        assert table.known("r")                                       # published once: not again
        with pytest.raises(DuplicateRequest):
            table.publish("r", [3], 5, now=1)
        # Remembered for abort_timeout only, as any tombstone.
        table.release("s", D1, now=0)
        table.expire(now=10)
        assert table.publish("s", [4], 5, now=10) is True and table.pending() == 1

    def test_release_by_the_puller_waits_for_the_running_transfer(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("r", [1], 5, now=0)
        table.lookup("r", D1, (3,))
        assert table.release("r", D1, now=1) is True
        assert table.take_releases() == []                  # the push may still write into D1's blocks
        peer, reply = table.transfer_done("r", None, now=2)
        assert peer == D1 and not reply.success and "released by its decode peer" in reply.error  # type: ignore[operator]
        assert table.take_releases() == ["r"]

    def test_release_by_another_peer_is_refused_while_one_pulls(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("r", [1], 5, now=0)
        table.lookup("r", D1, (3,))
        assert table.release("r", D2, now=1) is False
        assert table.transfer_done("r", None, now=2) == (D1, LookupReply("r", True, 5, (3,)))
        assert table.take_releases() == ["r"]
        assert table.release("r", D2, now=3) is True and table.take_releases() == []   # over already

    def test_discard_before_publish_is_not_a_release(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.discard("r", now=0)
        assert table.known("r")                             # the engine's id: refused, not freed later
        with pytest.raises(DuplicateRequest):
            table.publish("r", [1], 5, now=1)

    def test_release_all_on_shutdown(self) -> None:
        table = LookupTable(abort_timeout=10)
        table.publish("a", [1], 5, now=0)
        table.publish("b", [2], 5, now=0)
        table.lookup("b", D1, (3,))
        table.release_all("closed", now=1)
        assert sorted(table.take_releases()) == ["a", "b"] and table.pending() == 0


class TestPullTracker:
    def test_retries_with_backoff_until_done(self) -> None:
        pulls = PullTracker(resend_after=1.0, first_backoff=0.01, max_backoff=0.04)
        pulls.add("r", "p", [3], deadline=10, now=0)
        assert pulls.due(0, ready_peers=set()) == []                  # peer not ready yet
        assert pulls.due(0, {"p"}) == [("p", LookupAll("r", (3,), timeout_s=10.0))]
        assert pulls.due(0.5, {"p"}) == []                            # outstanding
        backoffs = []
        for now in (1.0, 2.0, 3.0, 4.0):
            pulls.on_reply(LookupReply("r", False), now)
            assert pulls.due(now, {"p"}) == []
            backoffs.append(round(pulls.next_event(now), 3))
            assert len(pulls.due(now + 1, {"p"})) == 1
        assert backoffs == [0.01, 0.02, 0.04, 0.04]
        pulls.on_reply(LookupReply("r", True, 7, (3,)), 5.0)
        status = pulls.poll("r")
        assert status.state is PullState.DONE and status.output_token == 7
        with pytest.raises(UnknownRequest):
            pulls.poll("r")

    def test_lost_reply_is_resent(self) -> None:
        pulls = PullTracker(resend_after=1.0)
        pulls.add("r", "p", [3], deadline=10, now=0)
        assert len(pulls.due(0, {"p"})) == 1
        assert pulls.due(0.9, {"p"}) == []
        assert len(pulls.due(1.0, {"p"})) == 1

    def test_deadline_with_and_without_an_outstanding_lookup(self) -> None:
        pulls = PullTracker(resend_after=100, grace=5)
        pulls.add("idle", "p", [1], deadline=1, now=0)
        pulls.add("asked", "p", [2], deadline=1, now=0)
        pulls.add("unready", "q", [3], deadline=1, now=0)
        pulls.due(0, {"p"})
        pulls.on_reply(LookupReply("idle", False), 0.1)
        pulls.expire(1.0, {"p"})
        assert isinstance(pulls.poll("idle").error, PullTimeout)
        assert isinstance(pulls.poll("unready").error, PeerUnavailable)
        # The peer may be writing into our blocks: wait for its answer, or for the grace.
        assert pulls.poll("asked").state is PullState.PENDING
        pulls.expire(5.9, {"p"})
        assert pulls.poll("asked").state is PullState.PENDING
        pulls.expire(6.0, {"p"})
        assert isinstance(pulls.poll("asked").error, PullTimeout)

    def test_cancel(self) -> None:
        pulls = PullTracker()
        pulls.add("quiet", "p", [1], deadline=10, now=0)
        assert pulls.cancel("quiet") is True
        pulls.add("asked", "p", [2], deadline=10, now=0)
        pulls.due(0, {"p"})
        assert pulls.cancel("asked") is False
        assert pulls.due(5, {"p"}) == []                 # no resend for a cancelled pull
        assert pulls.poll("asked").state is PullState.PENDING
        pulls.on_reply(LookupReply("asked", True, 1, (2,)), 1)
        assert "cancelled" in pulls.poll("asked").message  # type: ignore[operator]

    def test_cancel_releases_a_pull_that_had_not_ended(self) -> None:
        pulls = PullTracker()
        for rid in ("asked", "done"):
            pulls.add(rid, "p", [1], deadline=10, now=0)
        pulls.due(0, {"p"})
        pulls.add("quiet", "p", [1], deadline=10, now=0)   # no lookup sent yet
        pulls.on_reply(LookupReply("done", True, 1, (1,)), 1)
        assert pulls.cancel("quiet") is True and pulls.cancel("asked") is False
        assert pulls.cancel("asked") is False and pulls.cancel("done") is True
        assert pulls.take_notices(set()) == []             # no channel to p yet: they wait
        # The pull that ended tells its peer it holds the KV; the two cancelled ones release theirs.
        assert pulls.take_notices({"p"}) == [("p", Release("done", pulled=True)), ("p", Release("quiet")),
                                             ("p", Release("asked"))]
        assert pulls.take_notices({"p"}) == []

    def test_a_timed_out_pull_releases_only_on_a_peer_that_answered(self) -> None:
        pulls = PullTracker(resend_after=100)
        pulls.add("slow", "p", [1], deadline=1, now=0)
        pulls.add("unready", "q", [2], deadline=1, now=0)
        pulls.due(0, {"p"})
        pulls.on_reply(LookupReply("slow", False), 0.1)     # "not finished yet": it may publish later
        pulls.expire(1, {"p"})
        assert pulls.take_notices({"p", "q"}) == [("p", Release("slow"))]

    def test_release_without_a_pull_and_a_failed_peer_drops_its_releases(self) -> None:
        pulls = PullTracker()
        pulls.release("waited", "p")
        pulls.release("other", "q")
        pulls.fail_peer("q", PeerUnavailable("gone"))
        assert pulls.take_notices({"p", "q"}) == [("p", Release("waited"))]

    def test_terminal_error_and_duplicates(self) -> None:
        pulls = PullTracker()
        pulls.add("r", "p", [1], deadline=10, now=0)
        with pytest.raises(DuplicateRequest):
            pulls.add("r", "p", [1], deadline=10, now=0)
        pulls.due(0, {"p"})
        pulls.on_reply(LookupReply("r", False, error="aborted"), 1)
        assert "aborted" in pulls.poll("r").message  # type: ignore[operator]

    def test_restart_resends_and_peer_failure_fails_all(self) -> None:
        pulls = PullTracker(resend_after=100)
        pulls.add("a", "p", [1], deadline=10, now=0)
        pulls.add("b", "p", [2], deadline=10, now=0)
        pulls.due(0, {"p"})
        pulls.add("c", "q", [3], deadline=10, now=0)
        pulls.due(0, {"q"})
        pulls.resend_peer("p")
        assert sorted(m.request_id for _, m in pulls.due(0.1, {"p", "q"})) == ["a", "b"]
        pulls.fail_peer("p", LayoutMismatch("head_dim"))
        assert [pulls.poll(r).message for r in ("a", "b")] == ["head_dim", "head_dim"]
        assert pulls.poll("c").state is PullState.PENDING

    def test_lookups_name_the_blocks_the_pull_skips(self) -> None:
        pulls = PullTracker()
        pulls.add("r", "p", [8, 9], deadline=10, now=0, skipped=4)
        pulls.add("s", "p", [7], deadline=10, now=0)
        sent = {m.request_id: m for _, m in pulls.due(0, {"p"})}
        assert sent["r"].skipped_blocks == 4 and sent["r"].block_ids_in_peer_device == (8, 9)
        assert sent["s"].skipped_blocks is None

    def test_reply_for_other_blocks_is_a_protocol_error(self) -> None:
        pulls = PullTracker()
        pulls.add("r", "p", [1, 2], deadline=10, now=0)
        pulls.due(0, {"p"})
        pulls.on_reply(LookupReply("r", True, 5, (2, 1)), 1)
        status = pulls.poll("r")
        assert isinstance(status.error, ProtocolError) and "we offered [1, 2]" in status.message

    def test_take_finished_names_every_terminal_pull_once(self) -> None:
        pulls = PullTracker(resend_after=100, grace=5)
        for rid, peer in (("done", "p"), ("refused", "p"), ("cancelled", "p"), ("late", "p"), ("lost", "q")):
            pulls.add(rid, peer, [1], deadline=10, now=0)
        pulls.due(0, {"p"})
        assert pulls.cancel("cancelled") is False          # its lookup is outstanding: it ends later
        pulls.on_reply(LookupReply("done", True, 7, (1,)), 1)
        pulls.on_reply(LookupReply("refused", False, error="aborted"), 1)
        pulls.on_reply(LookupReply("cancelled", True, 7, (1,)), 1)
        pulls.on_reply(LookupReply("late", False), 1)      # not ready yet: not terminal
        pulls.fail_peer("q", PeerUnavailable("gone"))
        assert pulls.take_finished() == ["done", "refused", "cancelled", "lost"]
        assert pulls.take_finished() == []
        pulls.expire(10, {"p"})
        assert pulls.take_finished() == ["late"]
        # Announcing does not consume: poll still reports each terminal state once.
        assert [pulls.poll(r).state for r in ("done", "refused", "cancelled", "late", "lost")] == [
            PullState.DONE] + [PullState.FAILED] * 4
        assert pulls.take_finished() == [] and len(pulls) == 0

    def test_take_finished_leaves_out_what_poll_or_cancel_forgot(self) -> None:
        pulls = PullTracker()
        pulls.add("quiet", "p", [1], deadline=10, now=0)
        assert pulls.cancel("quiet") is True               # never announced
        pulls.add("polled", "p", [2], deadline=10, now=0)
        pulls.add("dropped", "p", [3], deadline=10, now=0)
        pulls.due(0, {"p"})
        pulls.on_reply(LookupReply("polled", True, 1, (2,)), 1)
        pulls.on_reply(LookupReply("dropped", True, 1, (3,)), 1)
        assert pulls.poll("polled").state is PullState.DONE
        assert pulls.cancel("dropped") is True             # already terminal: forgotten at once
        assert pulls.take_finished() == []

    def test_a_handshake_naming_another_engine_fails_the_pulls_expecting_one(self) -> None:
        pulls = PullTracker(resend_after=100)
        pulls.add("any", "p", [1], deadline=10, now=0)
        pulls.add("right", "p", [2], deadline=10, now=0, engine_id="P0")
        pulls.add("wrong", "p", [3], deadline=10, now=0, engine_id="P9")
        pulls.peer_ready("p", "P0")
        assert pulls.take_finished() == ["wrong"]
        status = pulls.poll("wrong")
        assert isinstance(status.error, EngineMismatch) and isinstance(status.error, HandshakeError)
        assert status.message == "pull of 'wrong': expected prefill engine P9 at p, found P0"
        assert sorted(m.request_id for _, m in pulls.due(0, {"p"})) == ["any", "right"]
        assert pulls.take_stale_peers() == []

    def test_a_pull_newer_than_the_handshake_asks_for_another(self) -> None:
        pulls = PullTracker(resend_after=100)
        pulls.peer_ready("p", "P0")
        pulls.add("new", "p", [1], deadline=10, now=0, engine_id="P1")
        assert pulls.due(0, {"p"}) == []                   # never asked of P0
        assert pulls.take_stale_peers() == ["p"] and pulls.take_stale_peers() == []
        pulls.peer_ready("p", "P1")                        # the peer had restarted as P1
        assert [m.request_id for _, m in pulls.due(0.1, {"p"})] == ["new"]
        # A pull naming P0 asks for a handshake too, and fails when it names P1 again.
        pulls.add("old", "p", [2], deadline=10, now=1, engine_id="P0")
        assert pulls.due(1, {"p"}) == [] and pulls.take_stale_peers() == ["p"]
        pulls.peer_ready("p", "P1")
        assert pulls.take_finished() == ["old"] and "found P1" in pulls.poll("old").message  # type: ignore[operator]
        # Another engine at the address means the one asked is gone, outstanding lookup or not.
        pulls.peer_ready("p", "P2")
        assert pulls.take_finished() == ["new"]
        assert pulls.poll("new").message == "pull of 'new': expected prefill engine P1 at p, found P2"


def test_an_unreachable_peer_fails_each_pull_that_waited_through_the_bound() -> None:
    tracker = PullTracker(unreachable_s=3)
    tracker.add("old", "p:1", [0], deadline=60, now=0)
    tracker.add("new", "p:1", [1], deadline=60, now=4)
    tracker.add("other", "q:1", [2], deadline=60, now=0)
    assert tracker.peer_unreachable("p:1", since=2, now=4.9) == 0    # "old" has waited 2.9 s of the refusals
    assert tracker.peer_unreachable("p:1", since=2, now=5) == 1
    status = tracker.poll("old")
    assert isinstance(status.error, PeerUnavailable)
    assert status.message == ("pull of 'old': prefill peer p:1 refused or did not answer every connection "
                              "attempt for 3 s (nothing listens there, or its host is gone)")
    assert tracker.peer_unreachable("p:1", since=2, now=6.9) == 0    # "new" came at 4: 2.9 s
    assert tracker.peer_unreachable("p:1", since=2, now=7) == 1
    assert tracker.poll("other").state is PullState.PENDING


def test_a_lost_peer_fails_its_pulls_at_once_and_later_pulls_wait_for_it() -> None:
    tracker = PullTracker()
    tracker.add("asked", "p:1", [0], deadline=30, now=0)
    tracker.add("queued", "p:1", [1], deadline=30, now=0)
    tracker.add("other", "q:1", [2], deadline=30, now=0)
    tracker.due(0, {"p:1"})                       # "asked" and "queued" have lookups outstanding now
    tracker.cancel("queued")
    tracker.peer_lost("p:1")
    assert sorted(tracker.take_finished()) == ["asked", "queued"]
    for rid in ("asked", "queued"):
        status = tracker.poll(rid)
        assert isinstance(status.error, PeerUnavailable) and "was lost" in status.message
    assert tracker.poll("other").state is PullState.PENDING
    tracker.add("after", "p:1", [3], deadline=30, now=1)
    tracker.expire(2, set())
    assert tracker.poll("after").state is PullState.PENDING
