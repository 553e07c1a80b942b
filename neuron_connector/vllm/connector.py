"""`NeuronConnector`: vLLM's KV connector hooks, delegated to SchedulerPlan and WorkerSide.

vLLM builds one instance in the scheduler and one in each worker process; the scheduler's
instance hands its StepOrders to the worker's inside `NeuronConnectorMetadata` every step,
and the worker's reports transfers back through `get_transfer_results`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorRole,
    KVConnectorTransferResults)
from vllm.v1.request import RequestStatus

from common.kv_events import KVEventsConfig
from common.tracing import Tracing
from neuron_connector.vllm.config import NeuronConnectorConfig
from neuron_connector.vllm.held_metrics import HeldBlocksPromMetrics, HeldBlocksReport, HeldBlocksStats
from neuron_connector.vllm.orders import Scheduled, StepOrders
from neuron_connector.vllm.plan import SchedulerPlan
from neuron_connector.vllm.worker_side import Plane, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request



def _log_through_vllm() -> None:
    """Our modules log under `neuron_connector`; inside vLLM they go where vLLM's own logs go."""
    ours, theirs = logging.getLogger("neuron_connector"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False


_log_through_vllm()


@dataclass
class NeuronConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side decided this step, for the worker side."""

    orders: StepOrders


@dataclass
class NeuronHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What the worker side tells the scheduler side once its signal plane runs."""

    plane: Plane


class NeuronConnector(KVConnectorBase_V1):
    """Prefill (kv_producer) publishes finished prompts' blocks on our signal plane; decode
    (kv_consumer) pulls them with lookup_all while the request waits for remote KV."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        self.config = events_named(NeuronConnectorConfig.from_vllm(transfer_config.kv_role,
                                                                   transfer_config.kv_connector_extra_config),
                                   vllm_config.kv_events_config)
        block_size = vllm_config.cache_config.block_size
        names = vllm_config.model_config.served_model_name
        model = names if isinstance(names, str) else names[0]
        self._plan = (SchedulerPlan(self.config.role, block_size, model)
                      if role == KVConnectorRole.SCHEDULER else None)
        self._plane: Plane | None = None   # the scheduler side's copy of the worker side's address
        self._held_report = HeldBlocksReport()
        tracing = Tracing.start(vllm_config.observability_config.otlp_traces_endpoint,
                                f"neuron-di-{self.config.role}-connector") if role == KVConnectorRole.WORKER else None
        self._worker = WorkerSide(self.config, model, tracing) if role == KVConnectorRole.WORKER else None

    # ---- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        assert self._plan is not None
        count = self._plan.matched_tokens(request.request_id, request.kv_transfer_params,
                                          request.num_prompt_tokens, num_computed_tokens,
                                          request.prompt_token_ids)
        self._plan.traced(request.request_id, request.trace_headers)
        return count, count > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._plan is not None
        self._plan.allocated(request.request_id, request.kv_transfer_params, blocks.get_block_ids()[0],
                             request.num_prompt_tokens, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._plan is not None
        self._plan.scheduled(scheduled_requests(scheduler_output))
        orders = self._plan.take_orders()
        orders.idle = scheduler_output.total_num_scheduled_tokens == 0
        return NeuronConnectorMetadata(orders)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._plan is not None
        self._plan.sent(connector_output.finished_sending or ())

    def has_pending_block_frees(self) -> bool:
        """Published blocks wait for their pull: vLLM waits for them to be freed rather than preempt."""
        return self._plan is not None and self._plan.holds_blocks()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler side of a prefill worker: the blocks held for pulls (held_metrics.py)."""
        if self._plan is None or self.config.role != "prefill":
            return None
        return self._held_report.take(*self._plan.held())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return HeldBlocksStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """A prefill server's held-blocks gauges on vLLM's /metrics."""
        transfer = vllm_config.kv_transfer_config
        config = NeuronConnectorConfig.from_vllm(transfer.kv_role, transfer.kv_connector_extra_config)
        if config.role != "prefill":
            return None
        return HeldBlocksPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                                     config.abort_timeout)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        shown = [m.plane for m in metadata.values() if isinstance(m, NeuronHandshakeMetadata)]
        self._plane = shown[0] if shown else None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A prefill leg whose blocks wait for a pull answers with where they wait (prefill_first)."""
        assert self._plan is not None
        capped = request.status == RequestStatus.FINISHED_LENGTH_CAPPED and request.output_token_ids
        first_token = request.output_token_ids[0] if capped else None
        leg = self._plan.leg(request.request_id, request.kv_transfer_params)
        held = self._plan.finished(request.request_id, request.kv_transfer_params, list(block_ids),
                                   request.num_prompt_tokens, first_token)
        if not held or leg is None or self._plane is None:
            return held, None
        return held, self._plane.handoff(leg.request_id).to_dict()

    # ---- worker side --------------------------------------------------------------------

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        assert self._worker is not None
        plane = self._worker.plane()
        return None if plane is None else NeuronHandshakeMetadata(plane)

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's orders are carried out at once, before its forward: vLLM calls `start_load_kv` only
        after the forward of a step without synchronous loads, which would start pulls a step late."""
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None and isinstance(connector_metadata, NeuronConnectorMetadata)
        self._worker.apply(connector_metadata.orders)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Pulls start when the step's orders are bound (bind_connector_metadata)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole requests, done before the request is scheduled: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Blocks are pushed from the pool when the decode peer asks: nothing to save per layer."""

    def wait_for_save(self) -> None:
        """The step's forward is done: publish the prompts it completed."""
        assert self._worker is not None
        self._worker.publish_computed()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        results = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(results.finished_sending, results.finished_recving,
                                          results.failed_recving)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


def scheduled_requests(scheduler_output: SchedulerOutput) -> list[Scheduled]:
    """The step's requests, with their (new) block ids and computed tokens, from vLLM's scheduler output."""
    tokens = scheduler_output.num_scheduled_tokens
    steps = [Scheduled(new.req_id, tuple(new.block_ids[0]) if new.block_ids else (), True, new.num_computed_tokens,
                       tokens.get(new.req_id, 0)) for new in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    for i, request_id in enumerate(cached.req_ids):
        blocks = cached.new_block_ids[i]
        steps.append(Scheduled(request_id, tuple(blocks[0]) if blocks else (), request_id in cached.resumed_req_ids,
                               cached.num_computed_tokens[i], tokens.get(request_id, 0)))
    return steps


def events_named(config: NeuronConnectorConfig, events: Any) -> NeuronConnectorConfig:
    """`config` naming the endpoint vLLM publishes KV cache events on (its --kv-events-config), if it does
    and the extra config names none: the registered record then tells the proxy where to follow them."""
    if config.kv_events or events is None or not events.enable_kv_cache_events or events.publisher != "zmq":
        return config
    endpoint = KVEventsConfig(events.endpoint, events.topic).connect_endpoint(config.http_host or config.kv_host)
    return replace(config, kv_events=endpoint)
