"""The decode side's integrity check, on a thread of its own so that a large pull never holds up
the signal plane.

Each pull's destination blocks are summed as the prefill's push lands them (transfer.landing:
the push raises a mark as its bytes arrive), so the check runs while the rest is still being
written, on another core than the writer's; when the reply with the sender's checksum comes,
only what landed since the last look is left to sum.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable, Iterable, Sequence

from neuron_connector.protocol import LookupReply
from transfer import TransferError
from transfer.landing import FOLLOW_POLL_S, LandedSum

log = logging.getLogger(__name__)

# How often pulls whose push has not started yet are looked at: the most a push's first
# bytes wait before the check starts following them. Every pull waits for its prefill first, so
# this is the follower's cost most of the time: with 8 pulls waiting, 2 ms cost the decode process
# 4.3% of a core, 10 ms 2.0%. A follower that starts late catches up (it sums at ~25 GB/s, the
# copy lands at ~9).
_WAITING_POLL_S = 0.01

# Pulls smaller than this are summed when their reply comes, not followed: following one saves at
# most its sum (~1.3 ms for 32 MiB, 0.1 ms for a 3 MiB pull of 800 built-in tokens), while its
# wake-ups from the request's start to its push cost the decode process CPU and GIL turns.
FOLLOW_MIN_BYTES = 32 << 20


class PullVerifier:
    """Sums the blocks of the pulls `watch` names as they land (those of `follow_min_bytes` or more,
    at `block_bytes` a block), and answers each reply `verify` queues with our checksum of the
    blocks it names: `on_verified(address, reply, checksum)`, called on this thread (checksum None
    when the blocks could not be summed).
    """

    def __init__(self, engine: Any, name: str, on_verified: Callable[[str, LookupReply, int | None], None],
                 block_bytes: int, follow_min_bytes: int = FOLLOW_MIN_BYTES) -> None:
        self._engine = engine
        self._block_bytes = block_bytes
        self._follow_min_bytes = follow_min_bytes
        self._on_verified = on_verified
        self._cond = threading.Condition()
        self._following: dict[str, tuple[tuple[int, ...], LandedSum]] = {}
        self._replies: deque[tuple[str, LookupReply]] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Follows the pull of `request_id` into `block_ids` if it is large enough to gain from it:
        call once they are ours for its handoff, before its first byte can land."""
        if len(block_ids) * self._block_bytes < self._follow_min_bytes:   # summed in one piece when its reply comes
            return
        try:
            landed = self._engine.follow_landing(block_ids)
        except TransferError as exc:   # the reply's checksum is then summed in one piece
            log.warning("cannot follow the blocks of %r as they land: %s", request_id, exc)
            return
        with self._cond:
            self._following[request_id] = (tuple(sorted(block_ids)), landed)
            self._cond.notify()

    def verify(self, address: str, reply: LookupReply) -> None:
        """Queues a successful reply that carries the sender's checksum."""
        with self._cond:
            self._replies.append((address, reply))
            self._cond.notify()

    def forget(self, request_ids: Iterable[str]) -> None:
        """Stops following pulls that ended."""
        with self._cond:
            for request_id in request_ids:
                self._following.pop(request_id, None)

    def close(self) -> None:
        """Stops the thread; replies still queued are dropped (their pulls end with the buffer)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._replies or self._following):
                    self._cond.wait()
                if self._stopping:
                    return
                if self._replies:
                    address, reply = self._replies.popleft()
                    followed = self._following.pop(reply.request_id, None)
                    following = None
                else:
                    following = [landed for _, landed in self._following.values()]
            if following is None:
                self._answer(address, reply, followed)
                continue
            if not any([landed.advance() for landed in following]):   # every one advanced
                midway = any(0 < landed.summed < landed.total for landed in following)
                with self._cond:
                    if not self._replies and not self._stopping:
                        self._cond.wait(FOLLOW_POLL_S if midway else _WAITING_POLL_S)

    def _answer(self, address: str, reply: LookupReply, followed: tuple[tuple[int, ...], LandedSum] | None) -> None:
        blocks = reply.block_ids_in_peer_device
        try:
            if followed is not None and followed[0] == tuple(sorted(blocks)):
                local: int | None = followed[1].finish()
            else:
                local = self._engine.checksum(blocks)
        except Exception as exc:  # noqa: BLE001 - ids not ours: the pull fails on them (or on the mismatch)
            log.warning("no checksum of the blocks of %r: %s", reply.request_id, exc)
            local = None
        try:
            self._on_verified(address, reply, local)
        except Exception:  # noqa: BLE001 - one bad reply must not stop the check of every pull
            log.exception("handing on the checked reply of %r failed", reply.request_id)
