"""The worker process's half of NeuronConnector: the pool, the transfer engine, the role's
buffer thread and the etcd registration, driven by the scheduler side's StepOrders."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from common.handoff import PrefillHandoff
from common.kv_secret import describe_plane, resolve_secret
from common.timeline import PULL_REPORTED, Timeline
from common.trace_spans import attach
from common.tracing import Tracing
from common.worker_record import VLLM_SERVER, WorkerRecord
from neuron_connector.errors import ConnectorError
from neuron_connector.pulls import PullState
from neuron_connector.recv_buffer import RecvBuffer
from neuron_connector.registry import Registration
from neuron_connector.send_buffer import SendBuffer
from neuron_connector.status import StatusServer
from neuron_connector.vllm.config import NeuronConnectorConfig
from neuron_connector.vllm.orders import Publish, StepOrders
from neuron_connector.vllm.prefill_calls import PrefillCalls
from neuron_connector.vllm.pool import distinct_layers, kv_layout, rebind
from transfer import KVLayout, create_transfer_engine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferResults:
    """Request ids (vLLM's) whose blocks vLLM may free (sent) or use (received), and failed loads."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def any(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


@dataclass(frozen=True, slots=True)
class Plane:
    """Where this worker's signal plane and status server listen (the scheduler side learns it)."""

    kv_host: str
    kv_port: int
    engine_id: str
    status_port: int = 0

    def handoff(self, uid: str) -> PrefillHandoff:
        """A prefill answer's kv_transfer_params: where the decode leg pulls `uid`'s blocks from."""
        return PrefillHandoff(self.kv_host, self.kv_port, self.engine_id, uid)


@dataclass(slots=True)
class _PendingPull:
    request_id: str
    aborted: bool = False
    start_error: str | None = None
    prefill_error: str | None = None   # decode_first: its prefill leg failed


class WorkerSide:
    """Prefill: publishes finished requests' blocks and reports them sent once released.
    Decode: pulls admitted requests' prompt blocks and reports them received (or failed)."""

    def __init__(self, config: NeuronConnectorConfig, model: str, tracing: Tracing | None = None) -> None:
        self.config = config
        self.model = config.model or model
        self.layout: KVLayout | None = None
        self._transfer = None
        self.send: SendBuffer | None = None
        self.recv: RecvBuffer | None = None
        self._registration: Registration | None = None
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()   # uids, from SendBuffer's thread
        self._published: dict[str, str] = {}      # uid -> vLLM request id, until released
        self._finished_seen: set[str] = set()     # published request ids vLLM reported finished
        self._unreported: set[str] = set()        # released, waiting for vLLM to report them finished
        self._pulls: dict[str, _PendingPull] = {}  # uid -> pull
        self._computed: list[Publish] = []        # prefill: publish once this step's forward is done
        self._prefill_calls: PrefillCalls | None = None   # decode: decode_first's prefill legs
        self._prefill_failures: dict[str, str] = {}       # uid -> why its prefill leg failed
        self._failures_lock = threading.Lock()
        self._activity = threading.Event()   # a buffer thread has something to report
        self._idle = False                   # the current step runs no tokens
        self.timeline = Timeline(config.role)
        self.tracing = tracing
        self._spans = attach(tracing, self.timeline, http=False)  # vLLM's HTTP request is vLLM's to trace
        self.status: StatusServer | None = None
        self.engine_id = ""

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Moves vLLM's caches onto our registered pool and starts serving the signal plane."""
        cfg = self.config
        layers = distinct_layers(kv_caches)
        self.layout = kv_layout(layers)
        try:
            secret = resolve_secret(cfg.kv_secret_file or None)
            self._transfer = create_transfer_engine(cfg.kv_transport, host=cfg.kv_host, secret=secret)
            rebind(layers, self._transfer.allocate_region(self.layout))
            engine_id = self.engine_id = cfg.engine_id or self._transfer.transfer_id
            if cfg.role == "prefill":
                self.send = SendBuffer(self._transfer, self.layout, engine_id, cfg.kv_host, cfg.kv_port,
                                       on_release=self._on_release, abort_timeout=cfg.abort_timeout,
                                       transfer_timeout=cfg.pull_timeout, secret=secret, timeline=self.timeline)
                self.send.start()
            else:
                self.recv = RecvBuffer(self._transfer, self.layout, engine_id, default_timeout=cfg.pull_timeout,
                                       on_finished=lambda _: self._activity.set(),
                                       secret=secret, integrity_check=cfg.kv_integrity_check,
                                       timeline=self.timeline)
                self.recv.start()
                self._prefill_calls = PrefillCalls(self._prefill_failed, cfg.pull_timeout + 5)
            if cfg.status_port >= 0:
                self.status = StatusServer(self.timeline, cfg.kv_host, cfg.status_port)
                self.status.start()
            if cfg.etcd:
                self._registration = Registration(cfg.etcd, self._record(engine_id), ttl=cfg.etcd_ttl)
                self._registration.start()
        except BaseException:
            self.close()
            raise
        log.info("NeuronConnector %s: %s pool %s over %s%s%s", cfg.role, engine_id, self.layout.describe(),
                 self._transfer.backend, f", signal plane on port {self.send.port}" if self.send else "",
                 f", status (GET /timeline, /metrics) on port {self.status.port}" if self.status else "")
        log.info("%s", describe_plane(cfg.kv_host, self.send.port if self.send else None,
                                      self._transfer.descriptor()["transports"], secret))

    def _record(self, engine_id: str) -> WorkerRecord:
        cfg = self.config
        return WorkerRecord(role=cfg.role, host=cfg.http_host or cfg.kv_host, http_port=cfg.http_port,
                            kv_host=cfg.kv_host, kv_port=self.send.port if self.send else 0,
                            engine_id=engine_id, model=self.model, transfer={"backend": cfg.kv_transport},
                            status_port=self.status.port if self.status else 0, server=VLLM_SERVER,
                            kv_events=cfg.kv_events)

    def plane(self) -> Plane | None:
        """Where the signal plane listens, once registered (the scheduler side's handoffs name it)."""
        if self.send is None and self.recv is None:
            return None
        return Plane(self.config.kv_host, self.send.port if self.send else 0, self.engine_id,
                     self.status.port if self.status else 0)

    # ---- once per step ------------------------------------------------------------------

    def apply(self, orders: StepOrders) -> None:
        """Carries out the scheduler side's orders; a failure fails that request, not the engine.
        Publishing waits for `publish_computed`, once the step's forward computed the blocks."""
        self._idle = orders.idle
        for uid, traceparent in orders.traced.items():
            if self._spans is not None:
                self._spans.adopt(uid, traceparent)
        for mark in orders.marks:
            self.timeline.mark(mark.uid, mark.phase, mark.at)
        self._computed += orders.publish
        for uid in orders.discard:
            if self.send is not None:
                self.send.discard(uid)
        for uid, decode_engine_id in orders.expect:
            if self.send is not None:
                self.send.expect(uid, decode_engine_id)
        for order in orders.prefill:
            assert self._prefill_calls is not None
            self._prefill_calls.send(order)
        for pull in orders.pull:
            assert self.recv is not None
            pending = self._pulls[pull.uid] = _PendingPull(pull.request_id)
            try:
                self.recv.request_pull(pull.uid, pull.host, pull.port, list(pull.block_ids),
                                       peer_engine_id=pull.engine_id)
            except (ConnectorError, ValueError) as exc:
                pending.start_error = f"the pull could not start: {exc}"   # reported by results()
        for release in orders.release:
            assert self.recv is not None
            with self._failures_lock:
                self._prefill_failures.pop(release.uid, None)
            try:
                self.recv.release(release.uid, release.host, release.port)
            except ConnectorError as exc:   # the prefill peer's abort timeout frees the blocks then
                log.warning("could not tell prefill %s:%s to release %s: %s", release.host, release.port,
                            release.uid, exc)

    def publish_computed(self) -> None:
        """The step's forward is done: the prompts it completed are published for their decode peers."""
        computed, self._computed = self._computed, []
        for item in computed:
            assert self.send is not None
            self._published[item.uid] = item.request_id
            try:
                self.send.publish(item.uid, list(item.block_ids), item.output_token)
            except (ConnectorError, ValueError) as exc:
                log.warning("could not publish %s (%s) for its decode peer: %s", item.request_id, item.uid, exc)
                self._released.put(item.uid)

    def _on_release(self, uid: str) -> None:
        self._released.put(uid)
        self._activity.set()

    def _prefill_failed(self, uid: str, message: str) -> None:
        with self._failures_lock:
            self._prefill_failures[uid] = message
        self._activity.set()

    def results(self, finished_req_ids: set[str]) -> TransferResults:
        """What ended since the last step. A step that ran nothing (vLLM steps on while requests wait for
        KV or for their blocks to be released) first waits up to `idle_wait` for something to end, so
        that the engine loop does not spin a core and starve the threads that move the KV."""
        self._activity.clear()
        results = self._collect(finished_req_ids)
        if self._idle and self.config.idle_wait > 0 and not results.any():
            self._activity.wait(self.config.idle_wait)
            results = self._collect(finished_req_ids)
        return results

    def _collect(self, finished_req_ids: set[str]) -> TransferResults:
        results = TransferResults()
        if self.send is not None:
            self._sent(finished_req_ids, results)
        if self.recv is not None:
            self._received(finished_req_ids, results)
        return results

    def _sent(self, finished_req_ids: set[str], results: TransferResults) -> None:
        while True:
            try:
                uid = self._released.get_nowait()
            except queue.Empty:
                break
            if (request_id := self._published.pop(uid, None)) is not None:
                self._unreported.add(request_id)
        # vLLM accepts a sent id only once it has told us that request finished.
        known = set(self._published.values()) | self._unreported
        self._finished_seen |= finished_req_ids & known
        ready = self._unreported & self._finished_seen
        self._unreported -= ready
        self._finished_seen -= ready
        results.finished_sending |= ready

    def _received(self, finished_req_ids: set[str], results: TransferResults) -> None:
        assert self.recv is not None
        for uid, pull in list(self._pulls.items()):
            if pull.request_id in finished_req_ids and not pull.aborted:
                pull.aborted = True       # the request ended (client gone) while its KV was coming
                if self.recv.cancel(uid):  # which also tells the prefill peer to free the blocks
                    del self._pulls[uid]
                    results.finished_recving.add(pull.request_id)
                    continue
            state, message = self._poll(uid, pull)
            if state is PullState.PENDING:
                continue
            del self._pulls[uid]
            results.finished_recving.add(pull.request_id)
            self.timeline.mark(uid, PULL_REPORTED)
            if state is PullState.FAILED:
                results.failed_recving.add(pull.request_id)
                self.timeline.fail(uid, message or "the KV pull failed")
                if not pull.aborted:
                    log.warning("KV pull of %s (%s) failed: %s", pull.request_id, uid, message)

    def _poll(self, uid: str, pull: _PendingPull) -> tuple[PullState, str]:
        if pull.start_error is None and self._prefill_failures:
            with self._failures_lock:
                failure = self._prefill_failures.pop(uid, None)
            if failure is not None and self.recv.cancel(uid):  # type: ignore[union-attr]
                pull.start_error = failure     # our blocks are free: fail it now
            elif failure is not None:
                pull.prefill_error = failure   # the peer may be writing: fail it once the pull ends
        if pull.start_error is not None:
            return PullState.FAILED, pull.start_error
        status = self.recv.poll(uid)  # type: ignore[union-attr]
        if status.state is PullState.FAILED and pull.prefill_error is not None:
            return status.state, pull.prefill_error
        return status.state, status.message

    def pending(self) -> int:
        """Published requests not yet released plus pulls not yet reported."""
        return len(self._published) + len(self._unreported) + len(self._pulls)

    def close(self) -> None:
        if self._prefill_calls is not None:
            self._prefill_calls.close()
            self._prefill_calls = None
        if self.status is not None:
            self.status.close()
            self.status = None
        if self._registration is not None:
            self._registration.stop()
            self._registration = None
        for buffer in (self.send, self.recv):
            if buffer is not None:
                buffer.close()
        self.send = self.recv = None
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None
        if self.tracing is not None:
            self.tracing.shutdown()
            self.tracing = None
