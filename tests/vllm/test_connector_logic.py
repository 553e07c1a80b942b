"""NeuronConnector's parts that need no vLLM: its settings, the scheduler side's orders, the pool."""
from __future__ import annotations

import pytest
import torch

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from neuron_connector.vllm import NeuronConnectorConfig
from neuron_connector.vllm.held_metrics import HeldBlocksPromMetrics, HeldBlocksReport
from neuron_connector.vllm.legs import blocks_to_pull, prompt_blocks
from neuron_connector.vllm.orders import Publish, Pull, Release, RemotePrefill, Scheduled
from neuron_connector.vllm.plan import SchedulerPlan
from neuron_connector.vllm.pool import distinct_layers, kv_layout, rebind
from transfer import KVLayout, create_transfer_engine

DECODE_PARAMS = {"role": "decode", "request_id": "u1", "remote_host": "10.0.0.5", "remote_port": 14579}


def test_config_from_vllm_settings() -> None:
    config = NeuronConnectorConfig.from_vllm("kv_consumer", {"kv_transport": "tcp", "pull_timeout": 5})
    assert (config.role, config.kv_transport, config.pull_timeout) == ("decode", "tcp", 5)
    assert NeuronConnectorConfig.from_vllm("kv_producer", None).role == "prefill"
    assert NeuronConnectorConfig.from_vllm("kv_consumer", None).kv_integrity_check is True
    assert NeuronConnectorConfig.from_vllm("kv_consumer", {"kv_integrity_check": False}).kv_integrity_check is False


@pytest.mark.parametrize("kv_role, extra, message", [
    ("kv_both", {}, "kv_producer \\(prefill\\) or kv_consumer"),
    ("kv_producer", {"kvport": 1}, "unknown kv_connector_extra_config keys \\['kvport'\\]"),
    ("kv_producer", {"kv_port": "1"}, "kv_port must be int"),
    ("kv_producer", {"kv_port": True}, "kv_port must be int"),
    ("kv_producer", {"kv_transport": "rdma"}, "kv_transport must be one of"),
    ("kv_consumer", {"kv_integrity_check": "yes"}, "kv_integrity_check must be bool"),
    ("kv_consumer", {"kv_integrity_check": 1}, "kv_integrity_check must be bool"),
    ("kv_producer", {"etcd": "127.0.0.1:2379"}, "http_port .* is required with etcd"),
    ("kv_consumer", {"pull_timeout": 0}, "pull_timeout must be positive"),
])
def test_bad_settings_are_refused_by_name(kv_role: str, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NeuronConnectorConfig.from_vllm(kv_role, extra)


def test_block_arithmetic() -> None:
    ids = [7, 3, 9, 4]
    assert prompt_blocks(ids, 129, 128) == (7, 3)
    assert prompt_blocks(ids, 128, 128) == (7,)
    # All 300 prompt tokens external: every prompt block; 256 of them cached locally: the tail.
    assert blocks_to_pull(ids, 300, 300, 128) == (7, 3, 9)
    assert blocks_to_pull(ids, 300, 44, 128) == (9,)


def test_decode_pulls_each_request_once() -> None:
    plan = SchedulerPlan("decode", block_size=128)
    assert plan.matched_tokens("r1", DECODE_PARAMS, 300, 0) == 300
    plan.allocated("r1", DECODE_PARAMS, [5, 6, 7], 300, 300)
    assert plan.take_orders().pull == [Pull("r1", "u1", "10.0.0.5", 14579, (5, 6, 7))]
    # Preempted and admitted again: computed locally, never pulled a second time.
    assert plan.matched_tokens("r1", DECODE_PARAMS, 300, 0) == 0
    assert plan.finished("r1", DECODE_PARAMS, [5, 6, 7], 300, None) is False
    orders = plan.take_orders()
    assert orders.pull == [] and orders.release == []     # the worker side's cancel tells prefill


def test_a_traced_request_hands_its_traceparent_to_the_worker_side_by_uid() -> None:
    plan = SchedulerPlan("decode", block_size=128)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    plan.matched_tokens("r1", DECODE_PARAMS, 300, 0)
    plan.traced("r1", {"traceparent": traceparent})
    plan.traced("r2", {"traceparent": traceparent})   # not a disaggregated leg: nothing to trace
    plan.matched_tokens("r3", DECODE_PARAMS | {"request_id": "u3"}, 300, 0)
    plan.traced("r3", None)                           # vLLM is not tracing
    assert plan.take_orders().traced == {"u1": traceparent}


def test_decode_leg_ended_before_its_pull_releases_it_on_prefill() -> None:
    """Aborted while it waited for blocks: its prefill peer must not hold the KV for nobody."""
    plan = SchedulerPlan("decode", block_size=128)
    assert plan.matched_tokens("r1", DECODE_PARAMS, 300, 0) == 300
    assert plan.finished("r1", DECODE_PARAMS, [], 300, None) is False
    assert plan.take_orders().release == [Release("u1", "10.0.0.5", 14579)]
    # A request served without DI has no prefill peer to tell.
    assert plan.finished("r2", None, [], 300, None) is False
    assert plan.take_orders().release == []


def test_decode_pull_names_the_prefill_engine_the_proxy_named() -> None:
    plan = SchedulerPlan("decode", block_size=128)
    params = {**DECODE_PARAMS, "remote_engine_id": "prefill-7"}
    assert plan.matched_tokens("r1", params, 300, 0) == 300
    plan.allocated("r1", params, [5, 6, 7], 300, 300)
    assert plan.take_orders().pull == [Pull("r1", "u1", "10.0.0.5", 14579, (5, 6, 7), engine_id="prefill-7")]


@pytest.mark.parametrize("params", [None, {"role": "prefill", "request_id": "u"},
                                    {"role": "decode", "request_id": "u", "remote_host": "h"},
                                    {"role": "decode", "request_id": "", "remote_host": "h", "remote_port": 1},
                                    {"role": "decode", "request_id": "u", "remote_host": "h", "remote_port": True},
                                    {**DECODE_PARAMS, "remote_engine_id": ""},
                                    {**DECODE_PARAMS, "remote_engine_id": 7}])
def test_decode_serves_requests_without_usable_params_itself(params) -> None:
    plan = SchedulerPlan("decode", block_size=128)
    assert plan.matched_tokens("r", params, 300, 0) == 0
    plan.allocated("r", params, [1, 2, 3], 300, 0)
    assert plan.take_orders().pull == []


def test_prefill_publishes_capped_requests_and_discards_the_rest() -> None:
    plan = SchedulerPlan("prefill", block_size=128)
    params = {"role": "prefill", "request_id": "u1"}
    assert plan.finished("r1", params, [4, 8, 2], 257, first_token=42) is True
    assert plan.finished("r2", {**params, "request_id": "u2"}, [1], 10, first_token=None) is False
    assert plan.finished("r3", None, [3], 10, first_token=5) is False
    orders = plan.take_orders()
    assert orders.publish == [Publish("r1", "u1", (4, 8, 2), 42)] and orders.discard == ["u2"]
    assert plan.take_orders().publish == []


def test_prefill_tells_the_worker_side_which_decode_engine_will_pull_a_leg() -> None:
    plan = SchedulerPlan("prefill", block_size=128)
    plan.leg("r1", {"role": "prefill", "request_id": "u1", "decode_engine_id": "d-7"})
    plan.leg("r1", {"role": "prefill", "request_id": "u1", "decode_engine_id": "d-7"})   # parsed once
    plan.leg("r2", {"role": "prefill", "request_id": "u2"})
    assert plan.take_orders().expect == [("u1", "d-7")]


def test_prefill_publishes_in_the_step_that_completes_its_prompt() -> None:
    """Not when vLLM reports it finished: with async scheduling that comes a whole step later."""
    plan = SchedulerPlan("prefill", block_size=128)
    params = {"role": "prefill", "request_id": "u1"}
    assert plan.matched_tokens("r1", params, 300, 0) == 0
    plan.scheduled([Scheduled("r1", (4, 8), True, 0, 256)])              # a first chunk
    assert plan.take_orders().publish == [] and not plan.holds_blocks()
    plan.scheduled([Scheduled("r1", (2,), False, 256, 44)])              # the rest
    assert plan.take_orders().publish == [Publish("r1", "u1", (4, 8, 2), None)]
    assert plan.holds_blocks()     # vLLM must not preempt it while its blocks wait for the pull
    assert plan.finished("r1", params, [4, 8, 2], 300, first_token=42) is True
    assert plan.take_orders().publish == []
    plan.sent({"r1"})
    assert not plan.holds_blocks()


def test_prefill_reports_the_blocks_it_holds_to_vllms_metrics_until_none_are_left() -> None:
    plan, report, registry = SchedulerPlan("prefill", block_size=4), HeldBlocksReport(), CollectorRegistry()

    class OwnGauge(Gauge):   # vLLM's gauge class, on a registry of the test's own
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    metrics = HeldBlocksPromMetrics(SimpleNamespace(kv_transfer_config=None),
                                    {Gauge: OwnGauge, Counter: Counter, Histogram: Histogram},
                                    ["model_name", "engine"], {0: ["m", "0"]}, abort_timeout=8.0)
    labels = {"model_name": "m", "engine": "0"}

    def gauge(name: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert (gauge("neuron_di_kv_blocks_held"), gauge("neuron_di_kv_abort_timeout_seconds")) == (0, 8.0)
    assert plan.finished("r1", {"role": "prefill", "request_id": "u1"}, [4, 8, 2], 10, first_token=7) is True
    assert plan.finished("r2", {"role": "prefill", "request_id": "u2"}, [5], 3, first_token=7) is True
    metrics.observe(report.take(*plan.held()).data)   # type: ignore[union-attr]
    assert gauge("neuron_di_kv_blocks_held") == 3 + 1 and 0 <= gauge("neuron_di_kv_held_oldest_seconds") < 5
    plan.sent({"r1", "r2"})
    metrics.observe(report.take(*plan.held()).data)   # type: ignore[union-attr]
    assert gauge("neuron_di_kv_blocks_held") == gauge("neuron_di_kv_held_oldest_seconds") == 0
    assert report.take(*plan.held()) is None          # nothing more to say until blocks are held again


def test_prefill_published_then_stopped_is_discarded_once_released() -> None:
    plan = SchedulerPlan("prefill", block_size=128)
    params = {"role": "prefill", "request_id": "u1"}
    plan.matched_tokens("r1", params, 10, 0)
    plan.scheduled([Scheduled("r1", (3,), True, 0, 10)])
    plan.take_orders()
    # EOS at token one: nobody pulls it, but a push may be running: held until the worker side releases it.
    assert plan.finished("r1", params, [3], 10, first_token=None) is True
    assert plan.take_orders().discard == ["u1"]


def test_decode_first_leg_sends_its_prefill_leg_once() -> None:
    plan = SchedulerPlan("decode", block_size=128, model="m")
    params = {**DECODE_PARAMS, "remote_url": "http://10.0.0.5:8100/"}
    assert plan.matched_tokens("r1", params, 3, 0, [5, 6, 7]) == 3
    assert plan.matched_tokens("r1", params, 3, 0, [5, 6, 7]) == 3
    assert plan.take_orders().prefill == [RemotePrefill("u1", "http://10.0.0.5:8100", {
        "model": "m", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
        "stream": False, "kv_transfer_params": {"role": "prefill", "request_id": "u1"}})]


def vllm_like_caches(layers: int, blocks: int = 6, heads: int = 2, block_size: int = 4,
                     head_dim: int = 8) -> dict[str, torch.Tensor]:
    """Per-layer tensors cut from one allocation, shaped as vLLM's CPU backend shapes them."""
    whole = torch.randn(layers, blocks, heads, block_size, 2 * head_dim)
    return {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(layers)}


def test_layout_of_vllm_caches() -> None:
    caches = vllm_like_caches(3)
    layers = distinct_layers({**caches, "shared.attn": caches["model.layers.1.self_attn.attn"]})
    assert len(layers) == 3
    assert kv_layout(layers) == KVLayout(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8,
                                         order="LBHKTD")
    with pytest.raises(ValueError, match="every layer"):
        kv_layout([layers[0], torch.zeros(6, 2, 4, 8)])


def test_rebound_layers_write_into_the_registered_pool() -> None:
    caches = vllm_like_caches(2)
    layers = distinct_layers(caches)
    layout = kv_layout(layers)
    with create_transfer_engine("shm") as engine:
        pool = engine.allocate_region(layout)
        rebind(layers, pool)
        # Written as vLLM's CPU attention writes: keys, then values, of each head of a block.
        keys, values = layers[1].view(6, 2, 2 * 4, 8).chunk(2, dim=2)
        keys[3, 0] = 1.5
        values[3, 1] = -2.0
        assert torch.all(pool[1, 3, 0, 0] == 1.5) and torch.all(pool[1, 3, 1, 1] == -2.0)
        assert pool.count_nonzero() == 2 * 4 * 8   # two (block_size x head_dim) writes, nothing else
        assert layers[0].data_ptr() == pool[0].data_ptr()
