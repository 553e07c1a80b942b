"""A worker's part in disaggregated serving, chosen once when the engine is built.

The engine calls its role's hooks around each step: `before_step` (take what the KV
connector's thread announced; on decode, start pulls) and `after_step` (on prefill, publish
what just finished). `EngineRole` itself is role "both": prefill and decode both happen
here, so every hook does nothing. `PrefillSide` and `DecodeSide` own their connector calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from scheduler import Scheduler
from common.handoff import DecodeParams, LegParams
from common.roles import DISAGGREGATED_ROLES
from worker.engine.kv_connector import KVConnector
from worker.engine.kv_write_back import WriteBackCounts
from worker.engine.request import Request, RequestOutput
from worker.engine.request_table import RequestTable
from worker.errors import InvalidRequestError, OtherRoleError


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What a role's hooks may touch: the scheduler, the request table, the engine's outputs."""

    scheduler: Scheduler
    requests: RequestTable
    emit: Callable[[Request, int], RequestOutput]   # the output of a request's newest token
    vocab_size: int


@dataclass(frozen=True, slots=True)
class Leg:
    """How a request takes part: a disaggregated leg (`remote_kv`) or not, and a decode leg's source."""

    remote_kv: bool = False
    pull_target: DecodeParams | None = None


class EngineRole:
    """Role "both": no KV moves between workers; `kv_transfer_params` are ignored."""

    name = "both"

    def __init__(self, parts: EngineParts, connector: KVConnector | None = None) -> None:
        self.check_connector(connector)
        self.parts = parts

    @classmethod
    def check_connector(cls, connector: KVConnector | None) -> None:
        """Raises ValueError unless `connector` suits this role (checked before anything starts)."""

    def leg(self, request_id: str, params: LegParams | None) -> Leg:
        return Leg()

    def before_step(self) -> list[RequestOutput]:
        return []

    def after_step(self, seqs: list[Request]) -> None:
        pass

    def abort(self, request: Request) -> None:
        """Ends an aborted request, now or (while a transfer may still touch its blocks) later."""
        self.parts.scheduler.finish(request, "abort")
        self.parts.requests.remove(request.request_id)

    def abandon(self, request_id: str) -> None:
        """The caller of a request that is done generating, or not here (yet), is gone."""

    def remembers(self, request_id: str) -> bool:
        """Whether the id is still in use outside the request table."""
        return False

    def has_work(self) -> bool:
        """Whether a step now would do something the scheduler alone does not see."""
        return False

    def wait_hint(self) -> float | None:
        """Seconds until the role must step again though nothing else happens (None: it need not)."""
        return None

    def holds_kv(self) -> bool:
        """Whether KV outside the request table is held or moving (write-backs): steps must go on to end it."""
        return False

    def write_back_counts(self) -> WriteBackCounts | None:
        """The totals of the answers' KV written back (`--kv-write-back`); None when it is off."""
        return None

    def close(self) -> None:
        pass


class DisaggregatedRole(EngineRole):
    """One leg of disaggregated requests: needs a KV connector of the same role."""

    def __init__(self, parts: EngineParts, connector: KVConnector | None = None) -> None:
        super().__init__(parts, connector)
        assert connector is not None
        self.kv = connector

    @classmethod
    def check_connector(cls, connector: KVConnector | None) -> None:
        if connector is None or connector.role != cls.name:
            raise ValueError(f"role {cls.name!r} needs a KV connector of the same role")

    def leg(self, request_id: str, params: LegParams | None) -> Leg:
        """A request without `kv_transfer_params` is served here whole."""
        if params is None:
            return Leg()
        if params.role in DISAGGREGATED_ROLES and params.role != self.name:
            raise OtherRoleError(f"kv_transfer_params.role is {params.role!r} but this worker serves role "
                                 f"{self.name!r} now; send the leg to a {params.role} worker")
        if params.role != self.name:
            raise InvalidRequestError(f"kv_transfer_params.role is {params.role!r} but this worker "
                                      f"serves role {self.name!r}")
        shared_id = params.request_id
        if shared_id is not None and shared_id != request_id:
            # The signal plane looks KV up by the engine's id: a mismatch would pull another request's KV.
            raise InvalidRequestError(f"kv_transfer_params.request_id {shared_id!r} is not this request's id "
                                      f"{request_id!r} (X-Request-Id)")
        return self._leg(params)

    def _leg(self, params: LegParams) -> Leg:
        return Leg(remote_kv=True)

    def close(self) -> None:
        self.kv.close()
