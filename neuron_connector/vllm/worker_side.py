"""The worker process's half of NeuronConnector: the pool, the transfer engine, the role's
buffer thread and the etcd registration, driven by the scheduler side's StepOrders."""
from __future__ import annotations

import logging
import queue
from dataclasses import dataclass, field

import torch

from common.kv_secret import describe_plane, resolve_secret
from neuron_connector.errors import ConnectorError
from neuron_connector.pulls import PullState
from neuron_connector.recv_buffer import RecvBuffer
from common.worker_record import WorkerRecord
from neuron_connector.registry import Registration
from neuron_connector.send_buffer import SendBuffer
from neuron_connector.vllm.config import NeuronConnectorConfig
from neuron_connector.vllm.plan import StepOrders
from neuron_connector.vllm.pool import distinct_layers, kv_layout, rebind
from transfer import KVLayout, create_transfer_engine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferResults:
    """Request ids (vLLM's) whose blocks vLLM may free (sent) or use (received), and failed loads."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _PendingPull:
    request_id: str
    aborted: bool = False
    start_error: str | None = None


class WorkerSide:
    """Prefill: publishes finished requests' blocks and reports them sent once released.
    Decode: pulls admitted requests' prompt blocks and reports them received (or failed)."""

    def __init__(self, config: NeuronConnectorConfig, model: str) -> None:
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

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Moves vLLM's caches onto our registered pool and starts serving the signal plane."""
        cfg = self.config
        layers = distinct_layers(kv_caches)
        self.layout = kv_layout(layers)
        try:
            secret = resolve_secret(cfg.kv_secret_file or None)
            self._transfer = create_transfer_engine(cfg.kv_transport, host=cfg.kv_host, secret=secret)
            rebind(layers, self._transfer.allocate_region(self.layout))
            engine_id = cfg.engine_id or self._transfer.transfer_id
            if cfg.role == "prefill":
                self.send = SendBuffer(self._transfer, self.layout, engine_id, cfg.kv_host, cfg.kv_port,
                                       on_release=self._released.put, abort_timeout=cfg.abort_timeout,
                                       transfer_timeout=cfg.pull_timeout, secret=secret)
                self.send.start()
            else:
                self.recv = RecvBuffer(self._transfer, self.layout, engine_id, default_timeout=cfg.pull_timeout,
                                       secret=secret, integrity_check=cfg.kv_integrity_check)
                self.recv.start()
            if cfg.etcd:
                self._registration = Registration(cfg.etcd, self._record(engine_id), ttl=cfg.etcd_ttl)
                self._registration.start()
        except BaseException:
            self.close()
            raise
        log.info("NeuronConnector %s: %s pool %s over %s%s", cfg.role, engine_id, self.layout.describe(),
                 self._transfer.backend, f", signal plane on port {self.send.port}" if self.send else "")
        log.info("%s", describe_plane(cfg.kv_host, self.send.port if self.send else None,
                                      self._transfer.descriptor()["transports"], secret))

    def _record(self, engine_id: str) -> WorkerRecord:
        cfg = self.config
        return WorkerRecord(role=cfg.role, host=cfg.http_host or cfg.kv_host, http_port=cfg.http_port,
                            kv_host=cfg.kv_host, kv_port=self.send.port if self.send else 0,
                            engine_id=engine_id, model=self.model, transfer={"backend": cfg.kv_transport})

    # ---- once per step ------------------------------------------------------------------

    def apply(self, orders: StepOrders) -> None:
        """Carries out the scheduler side's orders; a failure fails that request, not the engine."""
        for item in orders.publish:
            assert self.send is not None
            self._published[item.uid] = item.request_id
            try:
                self.send.publish(item.uid, list(item.block_ids), item.output_token)
            except (ConnectorError, ValueError) as exc:
                log.warning("could not publish %s (%s) for its decode peer: %s", item.request_id, item.uid, exc)
                self._released.put(item.uid)
        for uid in orders.discard:
            if self.send is not None:
                self.send.discard(uid)
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
            try:
                self.recv.release(release.uid, release.host, release.port)
            except ConnectorError as exc:   # the prefill peer's abort timeout frees the blocks then
                log.warning("could not tell prefill %s:%s to release %s: %s", release.host, release.port,
                            release.uid, exc)

    def results(self, finished_req_ids: set[str]) -> TransferResults:
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
            if state is PullState.FAILED:
                results.failed_recving.add(pull.request_id)
                if not pull.aborted:
                    log.warning("KV pull of %s (%s) failed: %s", pull.request_id, uid, message)

    def _poll(self, uid: str, pull: _PendingPull) -> tuple[PullState, str]:
        if pull.start_error is not None:
            return PullState.FAILED, pull.start_error
        status = self.recv.poll(uid)  # type: ignore[union-attr]
        return status.state, status.message

    def pending(self) -> int:
        """Published requests not yet released plus pulls not yet reported."""
        return len(self._published) + len(self._unreported) + len(self._pulls)

    def close(self) -> None:
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
