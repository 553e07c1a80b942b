"""How the planner acts on a fleet. Every connector reports the fleet it runs (`fleet()`), starts the
actions a plan lists (`apply()`), and follows them until done or failed (`progress()`).

    flip.py        role flips of our workers (POST /role), followed through GET /health
    local.py       worker processes on this host from a command template, stopped by drain; flips too
    kubernetes.py  the prefill and decode Deployments' replicas, through the Kubernetes API
"""
from __future__ import annotations

from typing import Protocol

from typing import TYPE_CHECKING

from planner.actions import Action
from planner.fleet import Fleet

if TYPE_CHECKING:
    from planner.connectors.flip import Flip
    from planner.connectors.local import Start


class Connector(Protocol):
    can_flip: bool    # moves workers between roles
    can_scale: bool   # starts and stops workers

    async def fleet(self) -> Fleet: ...

    async def apply(self, actions: list[Action]) -> None: ...

    async def progress(self) -> None: ...

    def under_way(self) -> tuple[list[Flip], list[Start]]: ...

    def restore(self, flips: list[Flip], starts: list[Start]) -> None: ...

    async def close(self) -> None: ...
