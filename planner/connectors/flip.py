"""Role flips of our workers: POST /role, then GET /health until the worker serves the new role."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx

from planner.actions import Action
from planner.errors import ConnectorError
from planner.fleet import EtcdWorkers, Fleet, Member, merge

log = logging.getLogger("planner.flip")


@dataclass
class Flip:
    member: Member      # role: the one it goes to; state "flipping"
    deadline: float     # wall clock


class RoleFlipper:
    """Flips workers between prefill and decode; `under_way` are the flips not over yet. Alone it is the
    `flip` connector (a fixed fleet: nothing is started or stopped)."""

    can_flip = True
    can_scale = False

    def __init__(self, etcd: EtcdWorkers, timeout_s: float, client: httpx.AsyncClient | None = None) -> None:
        self.etcd = etcd
        self.timeout_s = timeout_s
        self.client = client or httpx.AsyncClient(timeout=10.0)
        self.flips: dict[str, Flip] = {}

    async def fleet(self) -> Fleet:
        return merge(await self.etcd.read(), [f.member for f in self.flips.values()])

    async def apply(self, actions: list[Action]) -> None:
        for action in actions:
            if action.kind != "flip":
                log.warning("the flip connector cannot %s (a fixed fleet)", action)
                continue
            await self.flip(action)

    async def flip(self, action: Action) -> None:
        assert action.member is not None
        member = Member(action.member.address, action.role, "flipping")
        try:
            reply = await self.client.post(f"{member.url}/role", json={"role": action.role})
        except httpx.HTTPError as exc:
            raise ConnectorError(f"{action}: {exc}") from exc
        if reply.status_code not in (200, 202):
            raise ConnectorError(f"{action}: HTTP {reply.status_code} {reply.text[:200]}")
        log.info("%s: under way", action)
        self.flips[member.address] = Flip(member, time.time() + self.timeout_s)

    def restore(self, flips: list[Flip], starts: list = ()) -> None:   # type: ignore[assignment]
        """Flips a planner before this one started (from its saved state)."""
        self.flips.update({f.member.address: f for f in flips})

    def under_way(self) -> tuple[list[Flip], list]:
        return list(self.flips.values()), []

    async def progress(self) -> None:
        for address, flip in list(self.flips.items()):
            outcome = await self._outcome(flip)
            if outcome is not None:
                del self.flips[address]
                (log.info if outcome == "done" else log.warning)("flip of %s to %s: %s", address, flip.member.role,
                                                                 outcome)

    async def _outcome(self, flip: Flip) -> str | None:
        """"done", a failure, or None while under way."""
        try:
            health = (await self.client.get(f"{flip.member.url}/health")).json()
        except (httpx.HTTPError, ValueError) as exc:
            return None if time.time() < flip.deadline else f"failed: the worker does not answer ({exc})"
        role = (health.get("worker") or {}).get("role")
        if role == flip.member.role and not health.get("draining") and "changing_role" not in health:
            return "done"
        last = health.get("last_role_change") or {}
        if "changing_role" not in health and last.get("to") == flip.member.role and not last.get("ok"):
            return f"failed: {last.get('error')}"
        return None if time.time() < flip.deadline else "failed: not done in time"

    async def close(self) -> None:
        await self.client.aclose()
