"""What every fault scenario shares: its result and checks, the campaign it runs in, and the waits
that judge a stack afterwards (every KV block free, serving the reference answer again)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import httpx

from faults.clients import OK, call
from faults.load import LoadSize, Reference, Tally, body, prompts
from faults.stacks import ABORT_TIMEOUT_S, PULL_HOLD_S, FaultStack
from stack.worker_metrics import wait_blocks_free as wait_workers_free

# The longest any block is held on purpose after its request ended, and 10 s more.
BLOCKS_FREE_WITHIN_S = max(ABORT_TIMEOUT_S, PULL_HOLD_S) + 10.0


@dataclass
class ScenarioResult:
    """One scenario's counts (see fault_load.Tally) and measurements."""

    name: str
    topology: str
    tally: Tally = field(default_factory=Tally)
    blocks_leaked: dict[str, int] = field(default_factory=dict)  # worker -> blocks still used at the deadline
    recover_s: float | None = None        # restart of the killed process (or the cable cleared) -> serving again
    up_s: float | None = None             # of which: restart -> the process answers its own health check
    fault_blocks_free_s: float | None = None  # load under the fault ended -> the live workers at 0 blocks
    recovered: bool | None = None         # False: it did not serve again within its deadline
    abandoned_free_s: float | None = None  # last client gone -> both workers at 0 blocks
    skipped: str = ""                     # why the scenario could not run here ("" when it ran)
    planned: bool = False                 # a planned change (a drain): no request may fail at all
    exit_status: int | None = None        # of the drained process

    @property
    def passed(self) -> bool:
        t = self.tally
        return (t.hung == t.wrong == t.unclear == 0 and not any(self.blocks_leaked.values())
                and self.recovered is not False and not (self.planned and t.clear_error)
                and self.exit_status in (None, 0))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


@dataclass(frozen=True, slots=True)
class Campaign:
    """What every scenario shares: the load size, the reference outputs, the seed of the prompts."""

    size: LoadSize
    reference: Reference
    seed: int = 0


Scenario = Callable[[FaultStack, Campaign], ScenarioResult]


def wait_blocks_free(faults: FaultStack, timeout_s: float = BLOCKS_FREE_WITHIN_S,
                     without: str = "") -> dict[str, int]:
    """Blocks in use per live worker (all but `without`), polled until all are 0 or the deadline passes."""
    live = {name: url for name, url in faults.stack.worker_urls.items() if name != without}
    return wait_workers_free(live, timeout_s)


def wait_serving(faults: FaultStack, campaign: Campaign, timeout_s: float = 120.0) -> float | None:
    """When the stack serves again with everything it had: the proxy sees every worker healthy,
    every worker is registered in etcd (2p2d), and a request gets the reference answer; None if
    that did not happen within `timeout_s`."""
    probe = prompts(1, campaign.seed + 2)
    want = asyncio.run(campaign.reference.texts(probe))[0]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _complete(faults) and asyncio.run(_probe(faults.url, probe[0], want)):
            return time.monotonic()
        time.sleep(0.05)
    return None


def record_recovery(result: ScenarioResult, faults: FaultStack, campaign: Campaign, since: float,
                    what: str) -> None:
    """Sets `recovered` and `recover_s` (seconds from `since`); `what` names the fault's end in the problem."""
    served = wait_serving(faults, campaign)
    result.recovered = served is not None
    if served is None:
        result.tally.problems.append(f"the stack did not serve again after {what}")
    else:
        result.recover_s = round(served - since, 2)


def _complete(faults: FaultStack) -> bool:
    expected = {role: len(faults.names(f"{role} worker")) for role in ("prefill", "decode")}
    try:
        counts = httpx.get(f"{faults.url}/health", timeout=2.0).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    if any(counts.get(role) != {"known": n, "healthy": n} for role, n in expected.items()):
        return False
    return not faults.etcd or faults.registered() == sum(expected.values())


async def _probe(url: str, request: Any, want: str) -> bool:
    async with httpx.AsyncClient(timeout=30.0) as client:
        outcome = await call(client, f"{url}/v1/completions", body(request, False), 30.0)
    return outcome.verdict == OK and outcome.text == want
