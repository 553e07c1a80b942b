"""The decode side's word that a pull ended with the KV in its blocks (a `pulled` release), over real ZMQ and a
real transfer engine: the prefill side marks `decode_done` (what a prefill queue job's ack waits for) and frees
nothing for it; a pull that failed says nothing."""
from __future__ import annotations

from common.timeline import DECODE_DONE, RELEASED
from neuron_connector import PullState
from tests.helpers import wait_until
from tests.neuron_connector.conftest import Pair
from tests.neuron_connector.kv import wait_terminal


def _phases(pair: Pair, rid: str) -> dict[str, float]:
    record = pair.send.timeline.get(rid)
    return {} if record is None else record["phases"]


def test_a_done_pull_is_confirmed_to_the_prefill_side_after_its_blocks_left(pair: Pair) -> None:
    pair.send.publish("kept", [3, 7], output_token=5)
    pair.recv.request_pull("kept", "127.0.0.1", pair.send.port, [0, 1])
    assert wait_terminal(pair.recv, "kept").state is PullState.DONE
    wait_until(lambda: DECODE_DONE in _phases(pair, "kept"), timeout=5, what="the decode side's word")
    phases = _phases(pair, "kept")
    assert phases["push_done"] <= phases[DECODE_DONE]
    wait_until(lambda: pair.releases() == ["kept"], timeout=5, what="the release after the push")
    assert pair.send.stats.peer_releases == 0 and pair.send.pending() == 0


def test_a_failed_pull_is_not_confirmed(shm_pair: Pair) -> None:
    shm_pair.send.publish("short", [1, 2, 3], output_token=3)
    shm_pair.recv.request_pull("short", "127.0.0.1", shm_pair.send.port, [0, 4, 5, 6], deadline_s=30)
    assert wait_terminal(shm_pair.recv, "short", timeout=10).state is PullState.FAILED
    # A pull after it, on the same session: once its word came, any word of the first would have come before.
    shm_pair.send.publish("after", [7], output_token=3)
    shm_pair.recv.request_pull("after", "127.0.0.1", shm_pair.send.port, [8])
    assert wait_terminal(shm_pair.recv, "after").state is PullState.DONE
    wait_until(lambda: DECODE_DONE in _phases(shm_pair, "after"), timeout=5, what="the second pull's word")
    wait_until(lambda: RELEASED in _phases(shm_pair, "short"), timeout=5, what="the first one's blocks freed")
    assert DECODE_DONE not in _phases(shm_pair, "short")


def test_a_decode_side_release_is_its_word_too(shm_pair: Pair) -> None:
    shm_pair.send.publish("dropped", [2], output_token=1)
    shm_pair.recv.release("dropped", "127.0.0.1", shm_pair.send.port)
    wait_until(lambda: DECODE_DONE in _phases(shm_pair, "dropped"), timeout=5, what="the release")
    assert shm_pair.send.stats.peer_releases == 1
