"""A running prefill or decode worker changes role (POST /role), keeping its model loaded.

It drains its current role as a drain does (leaves etcd, refuses new requests with 503 so the proxy
sends them elsewhere, finishes what runs, and on prefill serves the KV not yet pulled), then builds
an engine of the other role on the same model (a new KV pool and signal plane), shows and registers
the record of the new role, and takes requests again. If the old role does not drain within the drain
timeout, or the new engine cannot start, it goes back to the old role; the outcome is in GET /health.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from werkzeug.exceptions import Conflict

from common.roles import DISAGGREGATED_ROLES
from worker.errors import DrainingError, invalid
from worker.server.async_engine import AsyncEngine
from worker.server.drain import Drain

logger = logging.getLogger(__name__)
# (role, the loaded model) -> a factory of an engine of that role on that model
EngineMaker = Callable[[str, Any], Callable[[], Any]]


@dataclass(frozen=True, slots=True)
class FlipOutcome:
    """How the last change of role ended."""

    to: str
    ok: bool
    seconds: float
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"to": self.to, "ok": self.ok, "seconds": round(self.seconds, 3), "error": self.error}


class RoleFlip:
    """One worker's changes of role, one at a time. `engine_changed` re-attaches what watches the engine
    (metrics, the image-part resolver); `publish` shows and registers the running engine's record;
    `role_changed`, if set, moves what serves a role outside the engine (the prefill queue's side) to the
    new role before it is published."""

    def __init__(self, engine: AsyncEngine, drain: Drain, make_engine: EngineMaker,
                 engine_changed: Callable[[], None], publish: Callable[[], Awaitable[None]],
                 leave: Callable[[], object]) -> None:
        self.engine, self.drain, self.make_engine = engine, drain, make_engine
        self.engine_changed, self.publish, self.leave = engine_changed, publish, leave
        self.target: str | None = None           # the role being changed to, while it runs
        self.last: FlipOutcome | None = None
        self.role_changed: Callable[[str], Awaitable[None]] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def role(self) -> str:
        engine = self.engine.llm_engine
        assert engine is not None
        return engine.config.role

    def health_fields(self) -> dict[str, Any]:
        """What GET /health shows of it: the role it changes to (`changing_role`), the last change's outcome."""
        fields: dict[str, Any] = {}
        if self.target is not None:
            fields["changing_role"] = self.target
        if self.last is not None:
            fields["last_role_change"] = self.last.to_dict()
        return fields

    def check(self, role: Any) -> bool:
        """Whether a change to `role` is due (False: this worker has that role); raises if it cannot be made."""
        if role not in DISAGGREGATED_ROLES:
            raise invalid(f"`role` must be one of {list(DISAGGREGATED_ROLES)}, got {role!r}", "role")
        if self.role not in DISAGGREGATED_ROLES:
            raise invalid(f"this worker serves role {self.role!r}: only prefill and decode workers change role",
                          "role")
        return role != self.role

    def request(self, role: Any) -> tuple[dict[str, Any], int]:
        """POST /role: the answer's body and status once the change started (or is not due); DrainingError
        while the worker drains, 409 while another change runs, InvalidRequestError for a role it cannot take."""
        if self.drain.started:
            raise DrainingError("this worker is draining; it changes role no more")
        if self.target is not None:
            raise Conflict(f"this worker is changing role to {self.target} already")
        current = self.role
        if not self.check(role):
            return {"status": "unchanged", "role": current}, 200
        self.start(role)
        return {"status": "changing_role", "from": current, "to": role}, 202

    def start(self, role: str) -> None:
        """Starts the change (the caller checked it and that no drain or other change runs)."""
        self.target = role
        self._task = asyncio.get_running_loop().create_task(self._run(role))

    async def _run(self, role: str) -> None:
        started, old = time.monotonic(), self.role
        logger.info("changing role %s -> %s: leaving the registry, finishing what runs (at most %g s)",
                    old, role, self.drain.timeout)
        error = None
        try:
            error = await self._flip(old, role)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the worker must not stay refusing forever
            logger.exception("changing role %s -> %s failed", old, role)
            error = f"{type(exc).__name__}: {exc}"
            if not self.engine.is_alive():   # no engine of either role could be built: the worker ends
                self.drain.start()
        finally:
            self.last = FlipOutcome(role, error is None, time.monotonic() - started, error)
            self.target = None
            if not self.drain.started:
                self.drain.refusing = None
        if error is None:
            logger.info("now serving role %s (changed in %.2f s)", role, self.last.seconds)
        else:
            logger.warning("role stays %s: %s", self.role, error)

    async def _flip(self, old: str, role: str) -> str | None:
        """Drains `old`, then runs `role`; the reason it stayed `old`, or None."""
        self.drain.refusing = f"it is changing role from {old} to {role}"
        await asyncio.get_running_loop().run_in_executor(None, self.leave)
        if not await self.drain.wait_idle(self.drain.timeout):
            error = f"the {old} role did not drain within {self.drain.timeout:g} s"
        else:
            model = self.engine.llm_engine.model   # type: ignore[union-attr]  # running: start() returned
            built = await self.engine.rebuild([self.make_engine(role, model), self.make_engine(old, model)])
            error = None if built == 0 else f"the {role} engine did not start: {self.engine.rebuild_error}"
            self.engine_changed()
            if self.role_changed is not None:
                await self.role_changed(self.role)
        if not self.drain.started:   # a drain that began meanwhile leaves the registry for good
            await self.publish()
        return error
