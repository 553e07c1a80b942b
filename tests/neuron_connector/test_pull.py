"""Pulls between a SendBuffer and a RecvBuffer over real ZMQ and real transfer engines."""
from __future__ import annotations

import random
import time

import pytest
import torch

from neuron_connector import (
    ConnectorError, DuplicateRequest, HandshakeError, PeerUnavailable, PullState, PullTimeout,
    RecvBuffer, SendBuffer, UnknownRequest)
from neuron_connector.errors import EngineMismatch
from stack.serving import free_port
from tests.helpers import wait_until
from tests.neuron_connector.conftest import Pair, running_pair
from tests.neuron_connector.kv import LAYOUT, engine_with_pool, wait_terminal
from transfer import create_transfer_engine


def _pull(pair: Pair, rid: str, dst: list[int], deadline_s: float | None = None) -> None:
    pair.recv.request_pull(rid, "127.0.0.1", pair.send.port, dst, deadline_s=deadline_s)


def test_full_pull_before_publish(pair: Pair) -> None:
    src, dst = [3, 7, 1], [0, 5, 9]
    _pull(pair, "r1", dst)
    # D asks before P has finished: it is told "not yet" and keeps asking.
    wait_until(lambda: pair.send.stats.not_ready >= 3, timeout=10, what="repeated lookups")
    assert pair.recv.poll("r1").state is PullState.PENDING
    assert pair.releases() == []

    pair.send.publish("r1", src, output_token=1234)
    status = wait_terminal(pair.recv, "r1")

    assert status.state is PullState.DONE and status.output_token == 1234, status
    assert torch.equal(pair.d_pool[:, :, dst], pair.p_pool[:, :, src])
    untouched = [b for b in range(pair.d_pool.shape[2]) if b not in dst]
    assert not pair.d_pool[:, :, untouched].any()
    wait_until(lambda: pair.releases() == ["r1"], timeout=5, what="on_release")
    assert pair.send.pending() == 0 and pair.send.stats.transfers_ok == 1
    [(seconds, num_blocks)] = pair.transfers   # the one push, timed, with its block count
    assert num_blocks == 3 and seconds > 0
    with pytest.raises(UnknownRequest):
        pair.recv.poll("r1")   # a terminal status is reported once


def test_many_pulls_in_parallel(pair: Pair) -> None:
    for i in range(6):
        pair.send.publish(f"m{i}", [i], output_token=100 + i)
    for i in range(6):
        _pull(pair, f"m{i}", [15 - i])
    tokens = [wait_terminal(pair.recv, f"m{i}").output_token for i in range(6)]
    assert tokens == [100, 101, 102, 103, 104, 105]
    for i in range(6):
        assert torch.equal(pair.d_pool[:, :, 15 - i], pair.p_pool[:, :, i])
    wait_until(lambda: sorted(pair.releases()) == [f"m{i}" for i in range(6)], timeout=5,
               what="six releases")


def test_unknown_id_fails_after_deadline(shm_pair: Pair) -> None:
    _pull(shm_pair, "ghost", [0], deadline_s=0.5)
    status = wait_terminal(shm_pair.recv, "ghost", timeout=10)
    assert status.state is PullState.FAILED
    assert isinstance(status.error, PullTimeout)
    assert "'ghost'" in status.message and "before the deadline" in status.message
    assert not shm_pair.d_pool.any()


def test_never_published_fails_and_late_publish_is_released(shm_pair: Pair) -> None:
    _pull(shm_pair, "late", [2], deadline_s=0.3)
    assert isinstance(wait_terminal(shm_pair.recv, "late", timeout=10).error, PullTimeout)
    wait_until(lambda: shm_pair.send.stats.peer_releases == 1, timeout=5, what="the decode side's release")
    shm_pair.send.publish("late", [4], output_token=1)
    # Nobody pulls any more, and the decode side said so: freed at once, not at abort_timeout (1 s).
    wait_until(lambda: shm_pair.releases() == ["late"], timeout=0.5, what="release at publish")
    assert shm_pair.send.pending() == 0


def test_never_pulled_is_released_after_abort_timeout(shm_pair: Pair) -> None:
    shm_pair.send.publish("orphan", [1, 2], output_token=7)
    assert shm_pair.send.pending() == 1
    wait_until(lambda: shm_pair.releases() == ["orphan"], timeout=10, what="release by abort_timeout")
    # A pull that comes too late gets a terminal error at once, not at its deadline.
    _pull(shm_pair, "orphan", [0, 1], deadline_s=30)
    status = wait_terminal(shm_pair.recv, "orphan", timeout=10)
    assert status.state is PullState.FAILED and "not pulled within" in status.message
    assert not shm_pair.d_pool.any()


def test_duplicate_publish_keeps_the_first_entry(pair: Pair) -> None:
    pair.send.publish("dup", [1, 2], output_token=5)
    with pytest.raises(DuplicateRequest, match="dup"):
        pair.send.publish("dup", [3], output_token=6)
    _pull(pair, "dup", [8, 9])
    status = wait_terminal(pair.recv, "dup")
    assert status.output_token == 5
    assert torch.equal(pair.d_pool[:, :, [8, 9]], pair.p_pool[:, :, [1, 2]])
    wait_until(lambda: pair.releases() == ["dup"], timeout=5, what="one release")


def test_discard_releases_and_fails_the_pull(shm_pair: Pair) -> None:
    shm_pair.send.publish("gone", [5], output_token=3)
    shm_pair.send.discard("gone")
    wait_until(lambda: shm_pair.releases() == ["gone"], timeout=5, what="release on discard")
    _pull(shm_pair, "gone", [5], deadline_s=30)
    status = wait_terminal(shm_pair.recv, "gone", timeout=10)
    assert status.state is PullState.FAILED and "aborted" in status.message
    # Discarding an id never published: no release, but its pull fails fast too.
    shm_pair.send.discard("never")
    _pull(shm_pair, "never", [6], deadline_s=30)
    assert "aborted" in wait_terminal(shm_pair.recv, "never", timeout=10).message
    assert shm_pair.releases() == ["gone"]


def test_block_count_mismatch_is_terminal(shm_pair: Pair) -> None:
    shm_pair.send.publish("short", [1, 2, 3], output_token=3)
    _pull(shm_pair, "short", [0, 4, 5, 6], deadline_s=30)
    status = wait_terminal(shm_pair.recv, "short", timeout=10)
    assert status.state is PullState.FAILED and "holds 3 blocks, peer offered 4" in status.message
    wait_until(lambda: shm_pair.releases() == ["short"], timeout=5, what="release")


def test_a_peer_with_the_prompt_head_cached_pulls_the_tail(shm_pair: Pair) -> None:
    shm_pair.send.publish("tail", [1, 2, 3], output_token=7)
    _pull(shm_pair, "tail", [9, 10], deadline_s=30)
    status = wait_terminal(shm_pair.recv, "tail", timeout=10)
    assert status.state is PullState.DONE and status.output_token == 7
    assert torch.equal(shm_pair.d_pool[:, :, [9, 10]], shm_pair.p_pool[:, :, [2, 3]])
    assert not shm_pair.d_pool[:, :, [0, 1, 11]].any()
    wait_until(lambda: shm_pair.releases() == ["tail"], timeout=5, what="release")


def test_prefill_side_argument_errors(shm_pair: Pair) -> None:
    with pytest.raises(ValueError, match="out of range"):
        shm_pair.send.publish("r", [16], output_token=1)
    with pytest.raises(ValueError, match="empty"):
        shm_pair.send.publish("r", [], output_token=1)
    shm_pair.send.close()
    with pytest.raises(ConnectorError, match="not serving"):
        shm_pair.send.publish("r", [1], output_token=1)
    assert shm_pair.releases() == []


def test_decode_side_argument_errors(shm_pair: Pair) -> None:
    with pytest.raises(UnknownRequest):
        shm_pair.recv.poll("nobody")
    with pytest.raises(ValueError, match="out of range"):
        _pull(shm_pair, "big", [16])
    _pull(shm_pair, "twice", [1], deadline_s=30)
    with pytest.raises(DuplicateRequest):
        _pull(shm_pair, "twice", [2])
    assert shm_pair.recv.cancel("nobody") is True


def test_cancel_waits_for_an_outstanding_lookup(shm_pair: Pair) -> None:
    _pull(shm_pair, "c1", [1], deadline_s=30)
    wait_until(lambda: shm_pair.send.stats.not_ready >= 1, timeout=10, what="a lookup")
    if shm_pair.recv.cancel("c1"):
        with pytest.raises(UnknownRequest):
            shm_pair.recv.poll("c1")
    else:
        status = wait_terminal(shm_pair.recv, "c1", timeout=10)
        assert status.state is PullState.FAILED and "cancelled" in status.message
    # No lookup goes out for a cancelled pull: publishing it later is never pulled.
    shm_pair.send.publish("c1", [1], output_token=1)
    wait_until(lambda: shm_pair.releases() == ["c1"], timeout=10, what="release")
    assert shm_pair.send.stats.transfers_ok == 0


def test_a_cancelled_pull_has_its_peer_free_the_request_when_published(pair: Pair) -> None:
    """The decode request went away while prefill still computed: prefill must not hold the
    blocks for its abort timeout (60 s here)."""
    _pull(pair, "gone", [1], deadline_s=30)
    wait_until(lambda: pair.send.stats.not_ready >= 1, timeout=10, what="a lookup")
    if not pair.recv.cancel("gone"):
        assert wait_terminal(pair.recv, "gone", timeout=10).state is PullState.FAILED
    wait_until(lambda: pair.send.stats.peer_releases == 1, timeout=5, what="the release")
    pair.send.publish("gone", [2, 3], output_token=1)
    wait_until(lambda: pair.releases() == ["gone"], timeout=1, what="release at publish")
    assert pair.send.pending() == 0 and pair.send.stats.transfers_ok == 0


def test_release_frees_a_request_never_pulled_published_or_not(pair: Pair) -> None:
    pair.send.publish("held", [1], output_token=1)
    pair.recv.release("held", "127.0.0.1", pair.send.port)
    pair.recv.release("early", "127.0.0.1", pair.send.port)
    wait_until(lambda: pair.releases() == ["held"], timeout=1, what="release of a published request")
    wait_until(lambda: pair.send.stats.peer_releases == 2, timeout=5, what="both releases")
    pair.send.publish("early", [2], output_token=1)
    wait_until(lambda: pair.releases() == ["held", "early"], timeout=1, what="release at publish")
    # A pull after the release fails at once, and nothing is written into our blocks.
    _pull(pair, "held", [3], deadline_s=30)
    status = wait_terminal(pair.recv, "held", timeout=5)
    assert status.state is PullState.FAILED and "released by its decode peer" in status.message
    assert not pair.d_pool.any() and pair.send.pending() == 0


def test_no_prefill_listening_fails_with_peer_unavailable(shm_pair: Pair) -> None:
    """At its deadline if that comes first; else once connect attempts have been refused for 3 s."""
    port = free_port()
    shm_pair.recv.request_pull("lost", "127.0.0.1", port, [0], deadline_s=0.5)
    shm_pair.recv.request_pull("refused", "127.0.0.1", port, [1], deadline_s=300)
    lost, refused = (wait_terminal(shm_pair.recv, rid, timeout=30) for rid in ("lost", "refused"))
    assert isinstance(lost.error, PeerUnavailable) and isinstance(refused.error, PeerUnavailable)
    assert "handshake" in lost.message and f"127.0.0.1:{port}" in lost.message
    assert f"prefill peer 127.0.0.1:{port} refused or did not answer every connection attempt" in refused.message
    assert not shm_pair.d_pool.any()


def test_close_releases_held_blocks(shm_pair: Pair) -> None:
    shm_pair.send.publish("held", [1], output_token=1)
    shm_pair.send.close()
    assert shm_pair.releases() == ["held"]
    shm_pair.send.close()   # idempotent
    assert shm_pair.releases() == ["held"]


def test_one_decode_pulls_from_two_prefills_on_demand(shm_pair: Pair) -> None:
    """xPyD: the RecvBuffer opens a DEALER per prefill peer the first time it needs one."""
    other_engine, other_pool = engine_with_pool("shm", seed=2)
    other = SendBuffer(other_engine, LAYOUT, "prefill-1", "127.0.0.1", 0, shm_pair.on_release)
    other.start()
    try:
        shm_pair.send.publish("x", [1], output_token=1)
        other.publish("y", [1], output_token=2)
        _pull(shm_pair, "x", [10])
        # Each handshake names its own prefill engine.
        shm_pair.recv.request_pull("y", "127.0.0.1", other.port, [11], peer_engine_id="prefill-1")
        assert wait_terminal(shm_pair.recv, "x").output_token == 1
        assert wait_terminal(shm_pair.recv, "y").output_token == 2
        assert torch.equal(shm_pair.d_pool[:, :, 10], shm_pair.p_pool[:, :, 1])
        assert torch.equal(shm_pair.d_pool[:, :, 11], other_pool[:, :, 1])
        assert sorted(shm_pair.recv.connection_dict) == sorted(
            [f"127.0.0.1:{shm_pair.send.port}", f"127.0.0.1:{other.port}"])
    finally:
        other.close()
        other_engine.close()


def test_engine_without_a_pool_is_a_handshake_error() -> None:
    engine = create_transfer_engine("tcp")
    recv = RecvBuffer(engine, LAYOUT, engine_id="127.0.0.1:8202")
    recv.start()
    try:
        with pytest.raises(HandshakeError, match="cannot describe its KV pool"):
            recv.request_pull("r", "127.0.0.1", 1, [0])
    finally:
        recv.close()
        engine.close()


def test_interleaved_publishes_and_pulls_keep_every_byte(pair: Pair) -> None:
    """Forty requests, published and pulled in shuffled orders, each into its own blocks."""
    rng = random.Random(7)
    # 16 blocks per pool: request i uses P blocks {i % 16} and D blocks {(5 * i) % 16}.
    # Requests run in waves of 16 so no two in flight share a D block.
    for wave in range(0, 40, 16):
        ids = list(range(wave, min(wave + 16, 40)))
        events = [("pub", i) for i in ids] + [("pull", i) for i in ids]
        rng.shuffle(events)
        for kind, i in events:
            if kind == "pub":
                pair.send.publish(f"w{i}", [i % 16], output_token=i)
            else:
                _pull(pair, f"w{i}", [(5 * i) % 16])
        for i in ids:
            assert wait_terminal(pair.recv, f"w{i}").output_token == i
            assert torch.equal(pair.d_pool[:, :, (5 * i) % 16], pair.p_pool[:, :, i % 16])
    wait_until(lambda: len(pair.releases()) == 40, timeout=10, what="forty releases")
    assert sorted(pair.releases()) == sorted(f"w{i}" for i in range(40))
    assert pair.send.pending() == 0


def test_on_finished_names_a_done_and_a_timed_out_pull(pair: Pair) -> None:
    pair.send.publish("done", [2], output_token=9)
    _pull(pair, "done", [3])
    _pull(pair, "late", [4], deadline_s=0.3)
    wait_until(lambda: sorted(pair.finishes()) == ["done", "late"], timeout=10, what="two on_finished calls")
    # Named once each, and only once they are terminal: poll has the result.
    assert pair.recv.poll("done").output_token == 9
    assert isinstance(pair.recv.poll("late").error, PullTimeout)
    assert sorted(pair.finishes()) == ["done", "late"]


def test_a_raising_on_finished_is_logged_and_the_thread_goes_on(
        shm_pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    named: list[str] = []

    def boom(request_id: str) -> None:
        named.append(request_id)
        raise RuntimeError("engine callback failed")

    engine, pool = engine_with_pool("shm")
    recv = RecvBuffer(engine, LAYOUT, engine_id="127.0.0.1:8203", on_finished=boom)
    recv.start()
    try:
        for rid, block in (("a", 1), ("b", 2)):
            shm_pair.send.publish(rid, [block], output_token=block)
            recv.request_pull(rid, "127.0.0.1", shm_pair.send.port, [block])
            wait_until(lambda: rid in named, timeout=10, what=f"on_finished({rid!r})")
            assert recv.poll(rid).output_token == block
        assert named == ["a", "b"]
        assert "boom('a') raised" in caplog.text
    finally:
        recv.close()
        engine.close()


def test_a_pull_names_the_prefill_engine_it_expects(pair: Pair) -> None:
    address = f"127.0.0.1:{pair.send.port}"
    pair.send.publish("right", [1], output_token=5)
    pair.send.publish("wrong", [2], output_token=6)
    expected = f"pull of 'wrong': expected prefill engine prefill-9 at {address}, found prefill-0"
    # Asked before any handshake: failed when the link becomes ready.
    pair.recv.request_pull("wrong", "127.0.0.1", pair.send.port, [8], peer_engine_id="prefill-9")
    status = wait_terminal(pair.recv, "wrong")
    assert isinstance(status.error, EngineMismatch) and isinstance(status.error, HandshakeError)
    assert status.message == expected
    pair.recv.request_pull("right", "127.0.0.1", pair.send.port, [9], peer_engine_id="prefill-0")
    assert wait_terminal(pair.recv, "right").output_token == 5
    assert torch.equal(pair.d_pool[:, :, 9], pair.p_pool[:, :, 1])
    # Asked on a ready link: checked again after a fresh handshake, and failed the same way.
    pair.recv.request_pull("wrong", "127.0.0.1", pair.send.port, [8], peer_engine_id="prefill-9")
    status = wait_terminal(pair.recv, "wrong")
    assert isinstance(status.error, EngineMismatch) and status.message == expected
    assert not pair.d_pool[:, :, 8].any()
    wait_until(lambda: pair.releases() == ["right"], timeout=5, what="the one release")
    assert pair.send.pending() == 1 and pair.send.stats.transfers_ok == 1   # "wrong" was never looked up


def test_a_pull_naming_a_restarted_prefill_handshakes_again(shm_pair: Pair) -> None:
    """Another prefill engine now serves the address: its handshake is asked for, not assumed."""
    port = shm_pair.send.port
    shm_pair.send.publish("a", [1], output_token=1)
    shm_pair.recv.request_pull("a", "127.0.0.1", port, [10], peer_engine_id="prefill-0")
    assert wait_terminal(shm_pair.recv, "a").output_token == 1
    shm_pair.send.close()
    engine, pool = engine_with_pool("shm", seed=3)
    restarted = SendBuffer(engine, LAYOUT, "prefill-1", "127.0.0.1", port, shm_pair.on_release)
    restarted.start()
    try:
        restarted.publish("b", [2], output_token=2)
        restarted.publish("c", [3], output_token=3)
        # The link is still ready with prefill-0's handshake: naming prefill-1 renews it.
        shm_pair.recv.request_pull("b", "127.0.0.1", port, [11], peer_engine_id="prefill-1")
        assert wait_terminal(shm_pair.recv, "b").output_token == 2
        assert torch.equal(shm_pair.d_pool[:, :, 11], pool[:, :, 2])
        # A pull still naming the old engine fails instead of pulling from the new one.
        shm_pair.recv.request_pull("c", "127.0.0.1", port, [12], peer_engine_id="prefill-0")
        status = wait_terminal(shm_pair.recv, "c")
        assert isinstance(status.error, EngineMismatch) and status.message.endswith("found prefill-1")
        assert not shm_pair.d_pool[:, :, 12].any()
    finally:
        restarted.close()
        engine.close()


def test_pulls_waiting_on_a_prefill_that_closes_end_then_not_at_their_deadline(shm_pair: Pair) -> None:
    """A prefill worker exits (its drain over) holding lookups of requests it never published (their
    prefill legs, refused by its drain, went to another worker): the pulls end now, cancelled or not."""
    for rid, block in (("waiting", 1), ("cancelled", 2)):
        _pull(shm_pair, rid, [block], deadline_s=60)
    wait_until(lambda: shm_pair.send.stats.not_ready >= 2, timeout=10, what="both lookups held")
    freed_at_once = shm_pair.recv.cancel("cancelled")   # False while its lookup is outstanding
    shm_pair.send.close()
    for rid in ("waiting",) if freed_at_once else ("waiting", "cancelled"):
        assert wait_terminal(shm_pair.recv, rid, timeout=5).state is PullState.FAILED


def test_requests_of_a_decode_engine_whose_session_went_are_released_within_seconds() -> None:
    with running_pair("shm") as pair:     # abort timeout 60 s: nothing here is freed by it
        _pull(pair, "asked", [1], deadline_s=60)              # its lookup names decode-0 as its puller
        wait_until(lambda: pair.send.stats.not_ready >= 1, timeout=10, what="a lookup held")
        pair.send.expect("named", "decode-0")                  # its prefill leg named decode-0
        pair.send.expect("elsewhere", "decode-9")              # an engine that never had a session here
        pair.send.publish("named", [2], output_token=1)
        pair.send.publish("elsewhere", [3], output_token=1)
        pair.recv.close()                                      # decode-0 is gone
        wait_until(lambda: pair.send.stats.orphaned == 2, timeout=10, what="decode-0's requests released")
        assert pair.releases() == ["named"] and pair.send.pending() == 1
        pair.send.publish("asked", [4], output_token=1)        # its prefill finishes after decode-0 went
        wait_until(lambda: pair.releases() == ["named", "asked"], timeout=1, what="release at publish")


@pytest.mark.parametrize("attempt", range(10))
def test_a_prefill_that_closes_once_its_blocks_are_released_still_delivers_the_pull(attempt: int) -> None:
    """A drained prefill worker exits as soon as its last push's blocks are released, which happens right
    after the push's reply is queued: the reply still reaches the decode peer, whose pull ends DONE."""
    with running_pair("shm") as pair:
        pair.send.publish("last", [2, 4], output_token=7)
        _pull(pair, "last", [1, 3])
        deadline = time.monotonic() + 10
        while not pair.releases():   # close the moment the drain would see nothing held
            assert time.monotonic() < deadline, "the push never released its blocks"
        pair.send.close()
        status = wait_terminal(pair.recv, "last", timeout=10)
        assert status.state is PullState.DONE and status.output_token == 7, status
        assert torch.equal(pair.d_pool[:, :, [1, 3]], pair.p_pool[:, :, [2, 4]])
