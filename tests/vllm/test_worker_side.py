"""NeuronConnector's worker halves of a prefill and a decode server, in one process over real
ZMQ and shared memory, driven with the orders vLLM's scheduler side would send."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from neuron_connector.vllm import NeuronConnectorConfig
from neuron_connector.vllm.orders import Publish, Pull, Release, StepOrders
from neuron_connector.vllm.worker_side import TransferResults, WorkerSide
from stack.serving import free_port
from tests.helpers import wait_until
from tests.vllm.test_connector_logic import vllm_like_caches


def step(side: WorkerSide, orders: StepOrders) -> None:
    """One engine step as the connector runs it: the orders, then (the forward done) the publishing."""
    side.apply(orders)
    side.publish_computed()


@contextmanager
def worker_sides(integrity_check: bool = True) -> Iterator[tuple[WorkerSide, WorkerSide, dict, dict]]:
    kv_port = free_port()
    prefill = WorkerSide(NeuronConnectorConfig("prefill", kv_port=kv_port, abort_timeout=30), "m")
    decode = WorkerSide(NeuronConnectorConfig("decode", pull_timeout=3, kv_integrity_check=integrity_check), "m")
    p_caches, d_caches = vllm_like_caches(3, blocks=8), vllm_like_caches(3, blocks=8)
    try:
        prefill.register(p_caches)
        decode.register(d_caches)
        yield prefill, decode, p_caches, d_caches
    finally:
        decode.close()
        prefill.close()


@pytest.fixture
def sides() -> Iterator[tuple[WorkerSide, WorkerSide, dict, dict]]:
    with worker_sides() as four:
        yield four


@pytest.fixture
def checked_sides() -> Iterator[tuple[WorkerSide, WorkerSide, dict, dict]]:
    with worker_sides(integrity_check=True) as four:
        yield four


def collect(side: WorkerSide, finished: set[str], want: str, timeout: float = 10) -> TransferResults:
    seen = TransferResults()

    def done() -> bool:
        step = side.results(finished)
        for name in ("finished_sending", "finished_recving", "failed_recving"):
            getattr(seen, name).update(getattr(step, name))
        return bool(getattr(seen, want))
    wait_until(done, timeout=timeout, what=want)
    return seen


def test_a_checked_pull_of_vllm_blocks_lands_every_layer(checked_sides) -> None:
    prefill, decode, p_caches, d_caches = checked_sides
    for tensor in p_caches.values():
        tensor.copy_(torch.randn_like(tensor))
    step(prefill, StepOrders(publish=[Publish("p-req", "uid1", (2, 7, 3), output_token=9)]))
    step(decode, StepOrders(pull=[Pull("d-req", "uid1", "127.0.0.1", prefill.send.port, (6, 0, 1))]))
    got = collect(decode, set(), "finished_recving")
    assert got.finished_recving == {"d-req"} and not got.failed_recving
    for name in p_caches:
        assert torch.equal(d_caches[name][[6, 0, 1]], p_caches[name][[2, 7, 3]])


def test_pull_lands_every_layer_and_prefill_reports_sent_after_vllm_finished_it(sides) -> None:
    prefill, decode, p_caches, d_caches = sides
    for name, tensor in p_caches.items():
        tensor.copy_(torch.randn_like(tensor))           # rebound tensors: this writes into the pool
    # Published as the connector publishes: before vLLM reports the first token (decode samples it again).
    step(prefill, StepOrders(publish=[Publish("p-req", "uid1", (5, 6))]))
    step(decode, StepOrders(pull=[Pull("d-req", "uid1", "127.0.0.1", prefill.send.port, (1, 2))]))
    got = collect(decode, set(), "finished_recving")
    assert got.finished_recving == {"d-req"} and not got.failed_recving
    for name in p_caches:
        assert torch.equal(d_caches[name][[1, 2]], p_caches[name][[5, 6]])
        assert not d_caches[name][[0, 3, 4, 5, 6, 7]].any()
    # Released, but vLLM has not yet said the request finished: not reported until it has.
    wait_until(lambda: prefill.send.pending() == 0, timeout=5, what="release")
    assert prefill.results(set()).finished_sending == set()
    assert prefill.results({"p-req", "other"}).finished_sending == {"p-req"}
    assert prefill.pending() == 0 and decode.pending() == 0


def test_a_discarded_request_fails_its_pull_at_once(sides) -> None:
    prefill, decode, _, _ = sides
    step(prefill, StepOrders(discard=["uid2"]))
    step(decode, StepOrders(pull=[Pull("d-req", "uid2", "127.0.0.1", prefill.send.port, (0,))]))
    got = collect(decode, set(), "failed_recving", timeout=2)
    assert got.failed_recving == got.finished_recving == {"d-req"}


def test_an_aborted_pull_gives_its_blocks_back(sides) -> None:
    prefill, decode, _, _ = sides
    step(decode, StepOrders(pull=[Pull("d-req", "never-published", "127.0.0.1", prefill.send.port, (3,))]))
    assert decode.results(set()).finished_recving == set()     # still waiting for prefill
    got = collect(decode, {"d-req"}, "finished_recving", timeout=5)
    assert got.finished_recving == {"d-req"} and decode.pending() == 0


def test_an_aborted_pull_has_prefill_free_the_request_when_it_publishes(sides) -> None:
    """The decode request went away while prefill still computed: prefill frees at once, not
    at its abort timeout (30 s here)."""
    prefill, decode, _, _ = sides
    step(decode, StepOrders(pull=[Pull("d-req", "uid7", "127.0.0.1", prefill.send.port, (3,))]))
    collect(decode, {"d-req"}, "finished_recving", timeout=5)
    wait_until(lambda: prefill.send.stats.peer_releases == 1, timeout=5, what="the decode side's release")
    step(prefill, StepOrders(publish=[Publish("p-req", "uid7", (5, 6), output_token=9)]))
    assert collect(prefill, {"p-req"}, "finished_sending", timeout=1).finished_sending == {"p-req"}
    assert prefill.send.pending() == 0 and prefill.pending() == 0


def test_a_decode_leg_that_never_pulled_releases_the_prefill_blocks(sides) -> None:
    prefill, decode, _, _ = sides
    step(prefill, StepOrders(publish=[Publish("p-req", "uid8", (5, 6), output_token=9)]))
    step(decode, StepOrders(release=[Release("uid8", "127.0.0.1", prefill.send.port)]))
    assert collect(prefill, {"p-req"}, "finished_sending", timeout=1).finished_sending == {"p-req"}
    assert prefill.send.pending() == 0 and decode.pending() == 0


def test_a_dead_prefill_peer_fails_the_pull_by_its_deadline(sides) -> None:
    _, decode, _, _ = sides
    step(decode, StepOrders(pull=[Pull("d-req", "uid3", "127.0.0.1", free_port(), (0, 1))]))
    got = collect(decode, set(), "failed_recving", timeout=3 + 10)
    assert got.failed_recving == {"d-req"}


def test_a_pull_naming_no_prefill_engine_is_not_checked(sides) -> None:
    """A static proxy does not know a prefill's engine id and names none."""
    prefill, decode, _, _ = sides
    step(prefill, StepOrders(publish=[Publish("p-req", "uid4", (5,), output_token=9)]))
    step(decode, StepOrders(pull=[Pull("d-req", "uid4", "127.0.0.1", prefill.send.port, (1,), None)]))
    got = collect(decode, set(), "finished_recving")
    assert got.finished_recving == {"d-req"} and not got.failed_recving


def test_a_pull_fails_when_another_prefill_engine_answers(sides) -> None:
    prefill, decode, _, _ = sides
    assert prefill.send is not None
    step(prefill, StepOrders(publish=[Publish("p-1", "uid5", (5,), output_token=9),
                                      Publish("p-2", "uid6", (6,), output_token=9)]))
    port, engine_id = prefill.send.port, prefill.send.engine_id
    step(decode, StepOrders(pull=[Pull("d-1", "uid5", "127.0.0.1", port, (1,), engine_id),
                                  Pull("d-2", "uid6", "127.0.0.1", port, (2,), "another-prefill")]))
    seen = TransferResults()

    def both_ended() -> bool:
        step = decode.results(set())
        seen.finished_recving |= step.finished_recving
        seen.failed_recving |= step.failed_recving
        return seen.finished_recving == {"d-1", "d-2"}
    wait_until(both_ended, timeout=10, what="both pulls to end")
    assert seen.failed_recving == {"d-2"}
