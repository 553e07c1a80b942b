"""The prefill side's pullers, sans I/O: which decode engine will pull each request, and which
engines lost their session, so the blocks held for a decode worker that is gone are freed in
seconds instead of at the abort timeout.

A request learns its puller from its prefill leg (the proxy names the decode engine it sent the
decode leg to) or from the first lookup of it. An engine is lost once it had a session on this
prefill worker and has none for `grace` seconds (a decode worker that reconnects or restarts its
signal plane handshakes again well within that); every request expected by a lost engine before it
was lost is then orphaned, once, and its owner releases it as if the engine had released it. One its
prefill leg names for the engine after that waits for its lookup: the proxy sent the decode leg to that
engine's next life (if that never comes, the proxy's abort of the request frees it). A request still
expected after `max_age` (its owner's abort timeout: it was never published, or already freed
without a word here) is forgotten.

A request is bound to the incarnation of its engine (neuron_connector.incarnation) that had the session
when the request learnt its puller (none while the engine has no session: then to the first that looks
it up). A decode worker restarted with the same engine id is another incarnation: when it gets its
session, every request bound to the old one is orphaned at once (the new process never asked for them),
however soon it came back, and a lookup of one from the new incarnation is refused (`bound_elsewhere`); one
from another engine is not (the proxy sent the decode leg elsewhere, say from a draining worker).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_GRACE_S = 1.0
PROBE_S = 0.5   # how often the owner probes its sessions while a request waits for its puller


@dataclass
class Pullers:
    """Expected pullers by request id, and engines without a session since when; not thread-safe."""

    grace: float = DEFAULT_GRACE_S
    max_age: float = 60.0
    _expected: dict[str, tuple[str, float]] = field(default_factory=dict)   # request id -> (engine, since)
    _bound_to: dict[str, tuple[str, str]] = field(default_factory=dict)   # request id -> (engine, its incarnation)
    _lost: dict[str, float] = field(default_factory=dict)      # engine id -> when its last session went
    _seen: set[str] = field(default_factory=set)               # engines that had a session here
    _lives: dict[str, str] = field(default_factory=dict)       # engine id -> its latest session's incarnation
    _replaced: list[tuple[str, str]] = field(default_factory=list)   # orphans of an engine that restarted
    _probed_at: float = 0.0

    def probe_due(self, now: float) -> bool:
        """Whether to probe the sessions now: twice a second while a request waits for its puller (with
        ROUTER_MANDATORY a send to a connection that is gone fails at once)."""
        if not self._expected or now - self._probed_at < PROBE_S:
            return False
        self._probed_at = now
        return True

    def expect(self, request_id: str, engine_id: str, now: float) -> None:
        """`engine_id` will pull `request_id`, as its prefill leg says (a lookup seen first says more)."""
        if request_id in self._expected:
            return
        self._expected[request_id] = (engine_id, now)
        if engine_id in self._lives and engine_id not in self._lost:
            self._bound_to[request_id] = (engine_id, self._lives[engine_id])

    def looked_up(self, request_id: str, engine_id: str, now: float, incarnation: str | None = None) -> None:
        """`engine_id` (in its life `incarnation`) asked for `request_id`: it is the puller (the leg may have
        been sent elsewhere)."""
        self._expected[request_id] = (engine_id, now)
        self._bound_to.pop(request_id, None)
        if incarnation is not None:
            self._bound_to[request_id] = (engine_id, incarnation)

    def bound_elsewhere(self, request_id: str, engine_id: str, incarnation: str | None) -> str | None:
        """The incarnation of `engine_id` that `request_id` is bound to, when it is not `incarnation` (None if it
        is, or unknown, or the request is bound to another engine: its decode leg was sent elsewhere)."""
        engine, bound = self._bound_to.get(request_id, (None, None))
        return bound if incarnation is not None and engine == engine_id and bound != incarnation else None

    def forget(self, request_ids: list[str]) -> None:
        """The requests' blocks were released: nothing to watch any more."""
        for request_id in request_ids:
            self._expected.pop(request_id, None)
            self._bound_to.pop(request_id, None)

    def session_up(self, engine_id: str, incarnation: str | None = None) -> None:
        """The engine got a session, in its life `incarnation`: a new one orphans the old one's requests."""
        self._seen.add(engine_id)
        self._lost.pop(engine_id, None)
        if incarnation is None:
            return
        if self._lives.get(engine_id, incarnation) != incarnation:
            old = [rid for rid, (engine, _) in self._expected.items()
                   if engine == engine_id and self._bound_to.get(rid, (engine, incarnation))[1] != incarnation]
            self._replaced += [(rid, engine_id) for rid in old]
            for rid in old:   # still bound (refused to the new life) until `orphans` hands them to the owner
                del self._expected[rid]
        self._lives[engine_id] = incarnation

    def session_gone(self, engine_id: str, now: float) -> None:
        """The engine's session went and no other holds its id."""
        if engine_id in self._seen:
            self._lost.setdefault(engine_id, now)

    def orphans(self, now: float) -> list[tuple[str, str]]:
        """(request id, engine id) of the requests whose puller is lost for `grace` seconds, each once."""
        gone = {engine for engine, since in self._lost.items() if now - since >= self.grace}
        old = [rid for rid, (_, since) in self._expected.items() if now - since >= self.max_age]
        # Only what the engine was expected to pull before it lost its session: a request named for it since
        # is for its next life, whose session may not be up yet (a worker that changed role and back).
        found = [(rid, engine) for rid, (engine, since) in self._expected.items()
                 if engine in gone and since <= self._lost[engine]]
        for rid in old + [rid for rid, _ in found if rid not in old]:
            del self._expected[rid]
            self._bound_to.pop(rid, None)
        replaced, self._replaced = self._replaced, []
        for rid, _ in replaced:
            self._bound_to.pop(rid, None)
        return replaced + [(rid, engine) for rid, engine in found if rid not in old]

    def __len__(self) -> int:
        return len(self._expected)
