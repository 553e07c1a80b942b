"""The fault campaign's two-host topology: 1P1D across two network-namespace hosts, and faults on
the cable between them.

Host a runs the prefill worker; host b the decode worker and the proxy (beside decode, so a
decode leg's error reaches the proxy even while the cable is cut). Workers use
`--kv-transport auto`, which picks tcp between the hosts. The campaign's clients and reference
worker stay in this process's namespace and reach the hosts over their management LAN, which no
cable fault touches.

A link scenario sets its LinkFault on the cable and runs the campaign's load (a cut starts once
a KV transfer is under way and lasts until every request has ended and the workers' blocks were
waited for), clears the cable, and measures the time until the stack serves the reference answer
again. Its result has the campaign's columns and checks (faults/judge.py).
start_two_hosts raises NetnsUnavailable where namespaces cannot be made (not root, no iproute2).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Sequence

from common.roles import DEFAULT_KV_PORT
from faults.judge import Campaign, Scenario, ScenarioResult, record_recovery, wait_blocks_free
from faults.load import Load, prompts
from faults.stacks import FaultStack
from faults.netns_hosts import Host, TwoHosts
from stack.serving import Stack, StackOptions, proxy_args, started, wait_healthy, worker_args
from stack.worker_metrics import metric_sum

# Every host has its own ports, so both use the defaults, as separate machines would.
PREFILL_PORT, DECODE_PORT, PROXY_PORT, KV_PORT = 8100, 8200, 8000, DEFAULT_KV_PORT
# Short, so a cut ends requests soon; long enough that prefills queued behind each other under
# load with delay and loss on the cable never run past it.
PULL_TIMEOUT_S = 10.0
TWO_HOST_OPTIONS = StackOptions(kv_transport="auto", worker_extra=(
    "--kv-pull-timeout", f"{PULL_TIMEOUT_S:g}", "--kv-abort-timeout", f"{2 * PULL_TIMEOUT_S:g}"))


@dataclass(frozen=True, slots=True)
class LinkFault:
    """What the cable does during one run of the load."""

    name: str
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    cut: bool = False


def worker_on(host: Host, role: str, port: int, options: StackOptions, extra: Sequence[str] = (),
              kv_port: int | None = None) -> list[str]:
    """A worker listening on every address of `host`, advertising (and moving KV on) its cable address."""
    return [*worker_args(role, port, options, kv_port, host="0.0.0.0"),
            "--kv-host", host.address, "--advertise-host", host.address, *extra]


def start_two_hosts(options: StackOptions = TWO_HOST_OPTIONS) -> FaultStack:
    """Builds the hosts, then prefill on a, decode and the proxy on b; leaving the FaultStack stops
    the processes and removes the hosts."""
    hosts = TwoHosts().__enter__()
    try:
        return FaultStack(_start_1p1d_across(hosts, options), "two_hosts", hosts=hosts)
    except BaseException:
        hosts.__exit__(None, None, None)
        raise


def _start_1p1d_across(hosts: TwoHosts, options: StackOptions) -> Stack:
    a, b = hosts.a, hosts.b

    def build(stack: Stack) -> None:
        stack.start("prefill worker", worker_on(a, "prefill", PREFILL_PORT, options, kv_port=KV_PORT),
                    prefix=a.prefix)
        stack.start("decode worker", worker_on(b, "decode", DECODE_PORT, options), prefix=b.prefix)
        stack.worker_urls = {"prefill worker": a.mgmt_url(PREFILL_PORT), "decode worker": b.mgmt_url(DECODE_PORT)}
        for url in stack.worker_urls.values():
            wait_healthy(f"{url}/health", stack.processes, options.startup_timeout_s)
        stack.start("proxy", proxy_args(PROXY_PORT, ["--prefill-ip", a.address, "--prefill-port", str(PREFILL_PORT),
                                                     "--decode-ip", b.address, "--decode-port", str(DECODE_PORT),
                                                     "--health-interval", "0.5"], host="0.0.0.0"),
                    prefix=b.prefix)
        stack.url = b.mgmt_url(PROXY_PORT)
        wait_healthy(f"{stack.url}/ready", stack.processes, options.startup_timeout_s)

    return started(build)


def link_fault(fault: LinkFault, input_len: tuple[int, int] = (10, 800),
               output_len: tuple[int, int] = (4, 16)) -> Scenario:
    """The campaign's load (prompts of `input_len` tokens, answers of `output_len`) with `fault` on the
    cable (see the module docstring). No answer is one token long, so every request moves KV across the
    cable (a one-token answer goes to the prefill worker alone; one caught by a cut ends with the proxy's
    502 once the prefill worker missed 3 health checks, see tests/proxy/test_worker_lost.py)."""
    def run(faults: FaultStack, campaign: Campaign) -> ScenarioResult:
        result = ScenarioResult(f"link_{fault.name}_{faults.topology}", faults.topology)
        requests = prompts(campaign.size.requests, campaign.seed + 7, input_len, output_len)
        load = Load(faults.url, requests, campaign.size)
        try:
            asyncio.run(_under_fault(faults, fault, load))
            result.blocks_leaked = wait_blocks_free(faults)
        finally:
            faults.link.clear()
        record_recovery(result, faults, campaign, time.monotonic(), f"the {fault.name} fault was cleared")
        asyncio.run(result.tally.add_load(load, campaign.reference))
        return result
    return run


async def _under_fault(faults: FaultStack, fault: LinkFault, load: Load) -> None:
    faults.link.set(delay_ms=fault.delay_ms, loss_pct=fault.loss_pct, up=True)
    running = asyncio.ensure_future(load.run())
    if fault.cut:
        await _cut_during_transfer(faults, running, load.size.deadline_s)
    await running


async def _cut_during_transfer(faults: FaultStack, load: asyncio.Future[Any], timeout_s: float) -> None:
    """Cuts the cable once the decode worker has a KV transfer under way (or the load ended)."""
    decode = faults.stack.worker_urls["decode worker"]
    deadline = time.monotonic() + timeout_s
    while not load.done() and time.monotonic() < deadline:
        if await asyncio.to_thread(metric_sum, decode, "neuron_di_requests_transferring") > 0:
            break
        await asyncio.sleep(0.01)
    faults.link.set(up=False)


LINK_SCENARIOS: dict[str, Scenario] = {
    "link_delay_loss_two_hosts": link_fault(LinkFault("delay_loss", delay_ms=20, loss_pct=1.5)),
    "link_cut_two_hosts": link_fault(LinkFault("cut", cut=True), input_len=(400, 1800)),
}
