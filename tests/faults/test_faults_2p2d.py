"""Fault scenarios against one 2P2D stack over a real etcd, started once for the module: each
scenario restarts what it killed, and the proxy must find it again through etcd."""
from __future__ import annotations

import asyncio
import os
import signal
from typing import Iterator

import httpx
import pytest

from faults.judge import BLOCKS_FREE_WITHIN_S, Campaign
from faults.load import Load, LoadSize, Tally, prompts
from faults.scenarios import SCENARIOS
from faults.stacks import FaultStack, start_2p2d
from stack.worker_metrics import wait_blocks_free as wait_workers_free
from tests.faults.checks import assert_clean
from tests.faults.conftest import SMALL
from tests.helpers import wait_until


@pytest.fixture(scope="module")
def stack() -> Iterator[FaultStack]:
    with start_2p2d() as faults:
        yield faults


# Killing a worker is covered on 1P1D by default; here the default suite keeps the proxy (the
# discovery path), and the worker kills run with --full.
@pytest.mark.parametrize("kind", [pytest.param("prefill", marks=pytest.mark.slow),
                                  pytest.param("decode", marks=pytest.mark.slow), "proxy"])
def test_kill_mid_load_then_restart_serves_again(stack: FaultStack, campaign: Campaign, kind: str) -> None:
    result = SCENARIOS[f"kill_{kind}_2p2d"][1](stack, campaign)
    assert_clean(result)
    assert result.recover_s is not None
    assert result.tally.ok >= SMALL.requests
    if kind != "proxy":  # a survivor could serve every request: the lost legs were sent to it
        assert result.tally.ok == result.tally.sent, result.tally.errors


def test_etcd_killed_mid_load_loses_no_request(stack: FaultStack, campaign: Campaign) -> None:
    result = SCENARIOS["kill_etcd_2p2d"][1](stack, campaign)
    assert_clean(result)
    assert result.tally.ok == result.tally.sent  # the proxy keeps the workers it knew
    assert result.recover_s is not None  # every worker registered again once etcd was back


# Last in the module: the two workers it kills stay dead (a restart would cost seconds).
def test_legs_on_killed_workers_that_never_answered_are_sent_again_and_answer_exactly(
        stack: FaultStack, campaign: Campaign) -> None:
    """A prefill and a decode worker take legs and never answer (stopped), then die (SIGKILL): the proxy
    (--resend-lost-legs) sends every request whose leg was lost again, to the survivors; every answer equals
    the `both` worker's, and no live worker holds a block."""
    victims = [stack.names("prefill")[0], stack.names("decode")[0]]
    addresses = [stack.stack.worker_urls[name].removeprefix("http://") for name in victims]
    load = Load(stack.url, prompts(8, campaign.seed + 31), LoadSize(requests=8, concurrency=8, deadline_s=90.0))

    def legs_on_victims() -> bool:
        metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
        return all(_inflight(metrics, address) > 0 for address in addresses)

    async def run() -> None:
        for name in victims:
            os.killpg(stack.stack.process(name).pid, signal.SIGSTOP)
        running = asyncio.create_task(load.run())
        await asyncio.to_thread(wait_until, legs_on_victims, timeout=30, interval=0.05, what="legs on the victims")
        for name in victims:
            stack.kill(name)
        await running

    asyncio.run(run())
    tally = Tally()
    asyncio.run(tally.add_load(load, campaign.reference))
    assert tally.ok == tally.sent == 8, (tally.problems, tally.errors)
    live = {name: url for name, url in stack.stack.worker_urls.items() if name not in victims}
    assert not any(wait_workers_free(live, BLOCKS_FREE_WITHIN_S).values())


def _inflight(metrics: str, address: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("proxy_worker_inflight_requests{") and f'worker="{address}"' in line)
