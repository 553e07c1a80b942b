"""Sessions and the KV secret on real sockets: a prefill SendBuffer, decode RecvBuffers and raw DEALERs."""
from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from typing import Any, Callable, Iterator

import pytest
import torch
import zmq

from common.kv_secret import new_nonce
from common.timeline import PULL_STARTED
from neuron_connector import EngineIdInUse, PullState, RecvBuffer, Unauthorized
from neuron_connector.peer_link import LinkState
from neuron_connector.protocol import Handshake, KVMapInit, LookupAll, Release
from tests.helpers import wait_until
from tests.neuron_connector.conftest import Pair, running_pair
from tests.neuron_connector.kv import LAYOUT, engine_with_pool, seeded, wait_terminal

SECRET, OTHER_SECRET = b"the deployment's secret", b"another deployment's secret"


@pytest.fixture
def make_pair() -> Iterator[Callable[[bytes | None, bytes | None], Pair]]:
    """Started tcp pairs with the given prefill and decode secrets, closed at the end."""
    with ExitStack() as pairs:
        yield lambda p_secret, d_secret: pairs.enter_context(
            running_pair("tcp", p_secret=p_secret, d_secret=d_secret))


@pytest.fixture
def raw_dealer() -> Iterator[Any]:
    ctx = zmq.Context()
    sockets: list[zmq.Socket] = []

    def connect(port: int, identity: bytes | None = None) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close()
    ctx.term()


def ask(sock: zmq.Socket, payload: bytes) -> dict[str, Any]:
    """The answer to `payload`, past the liveness probes other peers' handshakes cause."""
    sock.send(payload)
    while (reply := json.loads(sock.recv())).get("type") == "probe":
        pass
    return reply


def pull_exactly(pair: Pair, rid: str, src: list[int], dst: list[int], token: int) -> None:
    pair.send.publish(rid, src, token)
    pair.recv.request_pull(rid, "127.0.0.1", pair.send.port, dst)
    status = wait_terminal(pair.recv, rid)
    assert status.state is PullState.DONE and status.output_token == token, status
    assert torch.equal(pair.d_pool[:, :, dst], seeded(LAYOUT, 1)[:, :, src])


def test_the_same_secret_on_both_sides_pulls(make_pair) -> None:
    pair = make_pair(SECRET, SECRET)
    pull_exactly(pair, "a", [3, 4], [5, 6], 42)
    assert pair.send.stats.unauthorized == 0


def test_a_wrong_secret_is_refused_and_logged(make_pair, caplog: pytest.LogCaptureFixture) -> None:
    pair = make_pair(SECRET, OTHER_SECRET)
    pair.send.publish("a", [3], 7)
    with caplog.at_level(logging.WARNING, logger="neuron_connector.session_gate"):
        pair.recv.request_pull("a", "127.0.0.1", pair.send.port, [5])
        status = wait_terminal(pair.recv, "a")
    assert isinstance(status.error, Unauthorized), status
    assert status.message.startswith(f"prefill peer 127.0.0.1:{pair.send.port} refused our proof of the KV secret")
    assert pair.send.stats.unauthorized == 1
    assert "refused decode engine 'decode-0'" in caplog.text and "failed to prove the KV secret" in caplog.text
    assert not pair.d_pool[:, :, 5].any()


def test_a_pull_asked_for_while_the_refusal_comes_fails_with_it(make_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The link to the peer is mid-handshake when the pull starts and refused before the pull is counted on it:
    the pull still fails with the refusal (it waited out its deadline when the link was chosen first)."""
    pair = make_pair(SECRET, OTHER_SECRET)
    address = pair.recv.maybe_setup_buffer("127.0.0.1", pair.send.port)
    mark = pair.recv.timeline.mark

    def mark_once_refused(request_id: str, event: str) -> None:   # inside request_pull, before the pull is added
        mark(request_id, event)
        if event == PULL_STARTED:
            wait_until(lambda: pair.recv._links[address].state is LinkState.FAILED, timeout=10,
                       what="the refusal of the handshake begun before the pull")

    monkeypatch.setattr(pair.recv.timeline, "mark", mark_once_refused)
    pair.recv.request_pull("late", "127.0.0.1", pair.send.port, [5], deadline_s=60)
    status = wait_terminal(pair.recv, "late", timeout=15)
    assert isinstance(status.error, Unauthorized), status
    assert pair.send.stats.unauthorized == 2   # the link made anew for the pull was refused in turn


@pytest.mark.parametrize("p_secret, d_secret, fragment", [
    (SECRET, None, "requires the KV secret, and this decode worker has none (give it --kv-secret-file)"),
    (None, SECRET, "runs without the KV secret this decode worker has"),
])
def test_a_secret_on_one_side_only_fails_the_pull_and_the_prefill_side_logs_it(
        make_pair, p_secret, d_secret, fragment: str, caplog: pytest.LogCaptureFixture) -> None:
    pair = make_pair(p_secret, d_secret)
    pair.send.publish("a", [3], 7)
    with caplog.at_level(logging.WARNING, logger="neuron_connector.session_gate"):
        pair.recv.request_pull("a", "127.0.0.1", pair.send.port, [5])
        status = wait_terminal(pair.recv, "a")
        wait_until(lambda: pair.send.stats.unauthorized == 1, timeout=10, what="the prefill side's refusal")
    assert isinstance(status.error, Unauthorized) and fragment in status.message, status
    assert f"prefill peer 127.0.0.1:{pair.send.port} (prefill-0)" in status.message
    assert "refused decode engine 'decode-0'" in caplog.text


def test_an_unauthenticated_dealer_can_neither_look_up_nor_release(make_pair, raw_dealer) -> None:
    pair = make_pair(SECRET, SECRET)
    pair.send.publish("held", [3], 7)
    intruder = raw_dealer(pair.send.port)
    assert ask(intruder, Handshake("intruder", new_nonce()).to_bytes())["authenticated"] is True
    d_engine = pair.engines[1]
    refused = ask(intruder, KVMapInit(LAYOUT.to_dict(), d_engine.descriptor()).to_bytes())
    assert (refused["code"], refused["type"]) == ("unauthorized", "kv_map_init")
    assert "decode engine 'intruder' sent no proof of the KV secret" in refused["message"]
    forged = ask(intruder, KVMapInit(LAYOUT.to_dict(), d_engine.descriptor(), proof="0" * 64).to_bytes())
    assert forged["code"] == "unauthorized" and "failed to prove" in forged["message"]
    assert ask(intruder, LookupAll("held", (5,)).to_bytes())["code"] == "handshake_required"
    intruder.send(Release("held").to_bytes())
    wait_until(lambda: pair.send.stats.unauthorized == 3, timeout=5, what="the refused release")
    assert pair.send.pending() == 1 and pair.releases() == []
    # The rightful decode peer still gets the request, and nothing was written into its blocks before.
    assert not pair.d_pool[:, :, 5].any()
    pair.recv.request_pull("held", "127.0.0.1", pair.send.port, [5])
    assert wait_terminal(pair.recv, "held").output_token == 7


def test_a_handshake_that_proves_nothing_holds_no_engine_id(make_pair, raw_dealer) -> None:
    # A connection naming the decode worker's id before the decode worker connects, and staying
    # connected without ever proving the secret, must not lock the rightful worker out.
    pair = make_pair(SECRET, SECRET)
    squatter = raw_dealer(pair.send.port)
    assert ask(squatter, Handshake("decode-0", new_nonce()).to_bytes())["status"] == "ok"
    pull_exactly(pair, "mine", [1], [1], 10)
    assert pair.send.stats.engine_id_conflicts == 0
    # Now the id is bound to the proven session: the squatter's kv_map_init, even with a valid-looking
    # layout, is refused and the rightful session keeps pulling.
    d_engine = pair.engines[1]
    refused = ask(squatter, KVMapInit(LAYOUT.to_dict(), d_engine.descriptor(), proof="0" * 64).to_bytes())
    assert refused["code"] == "unauthorized", refused   # the proof is checked first
    pull_exactly(pair, "still-mine", [2], [2], 11)


def test_an_intruder_cannot_take_over_a_live_decode_session(make_pair, raw_dealer) -> None:
    pair = make_pair(None, None)
    pull_exactly(pair, "first", [1], [1], 10)
    # The intruder picks the victim's engine id both as its ZMQ identity and in its handshake.
    intruder = raw_dealer(pair.send.port, identity=b"decode-0")
    refused = ask(intruder, Handshake("decode-0", new_nonce()).to_bytes())
    assert (refused["code"], refused["type"]) == ("engine_id_in_use", "handshake")
    assert "refused engine id 'decode-0'" in refused["message"] and "unique --engine-id" in refused["message"]
    assert ask(intruder, LookupAll("r0", (2,)).to_bytes())["code"] == "handshake_required"
    intruder.close()
    assert pair.send.stats.engine_id_conflicts == 1
    for i in range(20):
        pull_exactly(pair, f"r{i}", [2 + i % 10], [3 + i % 12], 100 + i)


def test_a_second_live_decode_with_the_same_engine_id_is_refused(make_pair) -> None:
    pair = make_pair(None, None)
    pull_exactly(pair, "first", [1], [1], 10)
    twin_engine, twin_pool = engine_with_pool("tcp")
    twin = RecvBuffer(twin_engine, LAYOUT, "decode-0", default_timeout=10.0)
    twin.start()
    try:
        pair.send.publish("twin", [2], 11)
        twin.request_pull("twin", "127.0.0.1", pair.send.port, [2])
        status = wait_terminal(twin, "twin")
        assert isinstance(status.error, EngineIdInUse), status
        assert "engine 'decode-0'" in status.message and "give each decode worker a unique --engine-id" in status.message
        assert not twin_pool.any()
        pull_exactly(pair, "still-mine", [4], [4], 12)
        # Once the first holder is gone, the id is free: the twin's next handshake takes it.
        pair.recv.close()

        def pulled() -> bool:
            twin.request_pull("twin", "127.0.0.1", pair.send.port, [2])
            return wait_terminal(twin, "twin").output_token == 11
        wait_until(pulled, timeout=20, what="the twin's pull once the first holder left")
        assert torch.equal(twin_pool[:, :, 2], seeded(LAYOUT, 1)[:, :, 2])
    finally:
        twin.close()
        twin_engine.close()


def test_sessions_of_connections_that_left_are_forgotten(make_pair, raw_dealer) -> None:
    pair = make_pair(None, None)
    pull_exactly(pair, "first", [1], [1], 10)
    for i in range(5):
        gone = raw_dealer(pair.send.port)
        assert ask(gone, Handshake(f"gone-{i}", new_nonce()).to_bytes())["status"] == "ok"
        gone.close()
    newcomer = raw_dealer(pair.send.port)
    # Each handshake forgets the sessions whose connection is gone: the decode peer's and its own stay.
    wait_until(lambda: ask(newcomer, Handshake("newcomer", new_nonce()).to_bytes())["status"] == "ok"
               and len(pair.send._sessions) == 2, timeout=10, what="the gone sessions forgotten")
    pull_exactly(pair, "still", [2], [2], 11)
