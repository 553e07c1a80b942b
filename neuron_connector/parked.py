"""The prefill side's parked lookups, sans I/O: a `lookup_all` for a request not published yet is
held, not answered "not ready", until the request is published (then it is handled at once) or
`hold` seconds passed (then "not ready", and the decode peer asks again).

Answering at once would make the peer poll with backoff (up to its `max_backoff` late once the
blocks are ready, and dozens of lookups per prefill for this side's thread to handle while its
engine computes); a held lookup is answered the moment the blocks are there. The hold is kept
well under the peer's `resend_after`, so an unanswered lookup is never taken for a lost one, and
under the time the peer said it still waits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

M = TypeVar("M")
DEFAULT_HOLD_S = 0.5


@dataclass(frozen=True, slots=True)
class Parked(Generic[M]):
    """A held lookup: who sent it (`identity`), the message, and when it must be answered."""

    identity: bytes
    message: M
    until: float


class ParkedLookups(Generic[M]):
    """Held lookups by request id (one per request: a newer lookup replaces an older one)."""

    def __init__(self, hold: float = DEFAULT_HOLD_S) -> None:
        self.hold = hold
        self._parked: dict[str, Parked[M]] = {}

    def park(self, request_id: str, identity: bytes, message: M, now: float, wait_left: float | None) -> None:
        """Holds a lookup for at most `hold` s, and no longer than half of what the peer still waits."""
        hold = self.hold if wait_left is None else min(self.hold, max(0.0, wait_left / 2))
        self._parked[request_id] = Parked(identity, message, now + hold)

    def take(self, ready: Callable[[str], bool], now: float) -> tuple[list[Parked[M]], list[Parked[M]]]:
        """(lookups whose request is `ready` now: handle them again, lookups held long enough: answer
        "not ready"); both leave the table."""
        due = [rid for rid, p in self._parked.items() if ready(rid) or p.until <= now]
        taken = [(rid, self._parked.pop(rid)) for rid in due]
        return [p for rid, p in taken if ready(rid)], [p for rid, p in taken if not ready(rid)]

    def next_due(self, now: float) -> float | None:
        """Seconds until the earliest held lookup must be answered; None if none is held."""
        return min((p.until - now for p in self._parked.values()), default=None)

    def __len__(self) -> int:
        return len(self._parked)
