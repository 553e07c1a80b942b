"""What a SendBuffer (the prefill side's signal plane) counts, and how it records a running push."""
from __future__ import annotations

from dataclasses import dataclass

from transfer import CompletionToken


@dataclass
class SendStats:
    """Counters of one SendBuffer (read them for metrics; approximate under load)."""

    lookups: int = 0
    not_ready: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    released: int = 0
    peer_releases: int = 0     # `release` messages from decode peers (refused ones included)
    write_backs_offered: int = 0   # `write_back` offers from established decode sessions
    bad_messages: int = 0
    unauthorized: int = 0      # kv_map_init without a valid proof; releases, write-backs before the handshake
    engine_id_conflicts: int = 0   # handshakes naming the engine id of another live session
    orphaned: int = 0          # requests released because the decode engine that was to pull them is gone
    stale_pushes: int = 0      # pushes refused: the decode peer no longer held its blocks for the handoff
    stale_lookups: int = 0     # lookups refused: addressed to another incarnation of either side


@dataclass(frozen=True, slots=True)
class Push:
    """A queued transfer; `summed`: its token brings the checksum the lookup asked for."""

    token: CompletionToken
    started: float
    num_blocks: int
    summed: bool
    generation: int | None = None   # the decode peer's handoff generation, echoed in the reply
