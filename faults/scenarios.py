"""The fault scenarios: each drives load at a started stack, injects one fault, and judges the outcome.

Every scenario returns a ScenarioResult with the same checks: no call hung past its deadline,
every failure was a clear error, every success equals the reference output, and every KV block
of every live worker is free once the load stops. The tests (tests/faults/) run them with a small
load, faults/campaign.py with a larger one.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from typing import Callable

import httpx

from faults.inputs import malformed_http, malformed_zmq
from faults.clients import Outcome, leave, leave_mid_stream
from faults.judge import Campaign, Scenario, ScenarioResult, record_recovery, wait_blocks_free
from faults.load import Load, LoadSize, body, prompts
from faults.stacks import FaultStack
from faults.two_hosts import LINK_SCENARIOS


Fault = Callable[[FaultStack, str, ScenarioResult], None]


def _fault_then_restart(kind: str, fault: str, inject: Fault, planned: bool = False) -> Scenario:
    """`inject` the fault into the first process of `kind` mid-load, let the load run on, start it again, load
    again. `planned`: a drain, which no request may notice."""
    def run(faults: FaultStack, campaign: Campaign) -> ScenarioResult:
        result = ScenarioResult(f"{fault}_{kind}_{faults.topology}", faults.topology, planned=planned)
        victim = faults.names(kind)[0]
        size = campaign.size

        async def during() -> Load:
            load = Load(faults.url, prompts(size.requests, campaign.seed), size)
            running = asyncio.create_task(load.run())
            await load.wait_done(size.requests // 3, size.deadline_s)
            await asyncio.to_thread(inject, faults, victim, result)
            return await running
        load = asyncio.run(during())
        ended = time.monotonic()
        held = wait_blocks_free(faults, without=victim)
        if not any(held.values()):
            result.fault_blocks_free_s = round(time.monotonic() - ended, 2)
        restarted = time.monotonic()
        faults.restart(victim)
        result.up_s = round(time.monotonic() - restarted, 2)
        record_recovery(result, faults, campaign, restarted, f"{victim} was restarted")
        after = asyncio.run(Load(faults.url, prompts(size.requests, campaign.seed + 1), size).run())
        # Only the proxy's own clients may see their connection cut: it is the process that died.
        asyncio.run(result.tally.add_load(load, campaign.reference, cut_is_clear=kind == "proxy" and not planned))
        asyncio.run(result.tally.add_load(after, campaign.reference))
        result.blocks_leaked = {k: max(v, held.get(k, 0)) for k, v in wait_blocks_free(faults).items()}
        return result
    return run


def kill_and_restart(kind: str) -> Scenario:
    """SIGKILL the first process of `kind` mid-load, let the load run on, restart it, load again."""
    return _fault_then_restart(kind, "kill", lambda faults, victim, _: faults.kill(victim))


def _drain(faults: FaultStack, victim: str, result: ScenarioResult) -> None:
    result.exit_status = faults.drain(victim)
    if result.exit_status:
        result.tally.problems.append(f"{victim} exited with status {result.exit_status} after its drain")


def drain_and_restart(kind: str) -> Scenario:
    """SIGTERM (a drain) to the first worker of `kind` mid-load: it leaves the fleet, finishes or hands back what
    it holds and exits 0, and no request fails; then it is started again and a second load runs."""
    return _fault_then_restart(kind, "drain", _drain, planned=True)


def client_disconnect(faults: FaultStack, campaign: Campaign) -> ScenarioResult:
    """Clients leave before the first byte or mid-stream, among ordinary clients; then a burst of
    clients that all leave, timed from the last one gone to every block free."""
    result = ScenarioResult(f"client_disconnect_{faults.topology}", faults.topology)
    size = campaign.size
    rng = random.Random(campaign.seed)
    port = int(faults.url.rsplit(":", 1)[1])
    leavers = prompts(size.requests, campaign.seed + 3)
    long = [{**body(r, False), "max_tokens": 400} for r in leavers]

    async def abandon(client: httpx.AsyncClient) -> list[Outcome]:
        before_first_byte = [leave(port, "/v1/completions", b, rng) for b in long[::2]]
        mid_stream = [leave_mid_stream(client, f"{faults.url}/v1/completions", b, rng.randint(1, 5))
                      for b in long[1::2]]
        await asyncio.gather(*before_first_byte)
        return list(await asyncio.gather(*mid_stream))

    async def mixed() -> tuple[Load, list[Outcome]]:
        load = Load(faults.url, prompts(size.requests, campaign.seed), size)
        async with httpx.AsyncClient(timeout=size.deadline_s) as client:
            _, left = await asyncio.gather(load.run(), abandon(client))
        return load, left

    load, left = asyncio.run(mixed())
    asyncio.run(result.tally.add_load(load, campaign.reference))
    result.tally.add_all(left)
    result.blocks_leaked = wait_blocks_free(faults)

    async def burst() -> list[Outcome]:
        async with httpx.AsyncClient(timeout=size.deadline_s) as client:
            return await abandon(client)
    left = asyncio.run(burst())
    gone = time.monotonic()
    result.tally.add_all(left)
    leaked = wait_blocks_free(faults)
    result.abandoned_free_s = round(time.monotonic() - gone, 3)
    result.blocks_leaked = {k: max(v, leaked[k]) for k, v in result.blocks_leaked.items()}
    return result


def malformed(kind: str) -> Scenario:
    """Bad input (`kind` "http" or "zmq") sent while ordinary clients load the stack."""
    inputs = {"http": malformed_http, "zmq": malformed_zmq}[kind]

    def run(faults: FaultStack, campaign: Campaign) -> ScenarioResult:
        result = ScenarioResult(f"malformed_{kind}_{faults.topology}", faults.topology)

        async def under_load() -> tuple[Load, list[Outcome]]:
            load = Load(faults.url, prompts(campaign.size.requests, campaign.seed + 4), campaign.size)
            _, bad = await asyncio.gather(load.run(), inputs(faults, campaign.size.deadline_s))
            return load, bad
        load, bad = asyncio.run(under_load())
        asyncio.run(result.tally.add_load(load, campaign.reference))
        result.tally.add_all(bad)
        result.blocks_leaked = wait_blocks_free(faults)
        return result
    return run


def slow_client(faults: FaultStack, campaign: Campaign) -> ScenarioResult:
    """Streaming clients that read one event every 50 ms, slower than tokens are made, for 200
    tokens each, among ordinary clients."""
    result = ScenarioResult(f"slow_client_{faults.topology}", faults.topology)
    size = campaign.size
    slow_size = LoadSize(max(2, size.concurrency // 2), max(2, size.concurrency // 2), size.deadline_s)
    long = [replace(r, output_len=200) for r in prompts(slow_size.requests, campaign.seed + 5)]
    slow = Load(faults.url, long, slow_size, stream=True, read_delay_s=0.05)
    normal = Load(faults.url, prompts(size.requests, campaign.seed + 6), size)

    async def both() -> None:
        await asyncio.gather(slow.run(), normal.run())
    asyncio.run(both())
    asyncio.run(result.tally.add_load(slow, campaign.reference))
    asyncio.run(result.tally.add_load(normal, campaign.reference))
    result.blocks_leaked = wait_blocks_free(faults)
    return result


SCENARIOS: dict[str, tuple[str, Scenario]] = {
    "kill_prefill_1p1d": ("1p1d", kill_and_restart("prefill")),
    "kill_decode_1p1d": ("1p1d", kill_and_restart("decode")),
    "kill_proxy_1p1d": ("1p1d", kill_and_restart("proxy")),
    "client_disconnect_1p1d": ("1p1d", client_disconnect),
    "malformed_http_1p1d": ("1p1d", malformed("http")),
    "malformed_zmq_1p1d": ("1p1d", malformed("zmq")),
    "slow_client_1p1d": ("1p1d", slow_client),
    "kill_prefill_2p2d": ("2p2d", kill_and_restart("prefill")),
    "kill_decode_2p2d": ("2p2d", kill_and_restart("decode")),
    "kill_proxy_2p2d": ("2p2d", kill_and_restart("proxy")),
    "kill_etcd_2p2d": ("2p2d", kill_and_restart("etcd")),
    "drain_prefill_2p2d": ("2p2d", drain_and_restart("prefill")),
    "drain_decode_2p2d": ("2p2d", drain_and_restart("decode")),
    **{name: ("two_hosts", scenario) for name, scenario in LINK_SCENARIOS.items()},
}
