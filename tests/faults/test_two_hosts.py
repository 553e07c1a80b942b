"""Prefill and decode on two hosts (network namespaces joined by a cable, faults/netns_hosts.py),
the fault campaign's two-host topology: `auto` moves KV over tcp between them, answers equal a
single `both` worker's, and faults on the cable (delay, loss, a cut while KV moves) end every
request exactly or with a clear error, with no request left hanging and no KV block left in use.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator

import httpx
import pytest

from faults.judge import Campaign, ScenarioResult, wait_serving
from faults.load import LoadSize
from faults.stacks import FaultStack
from faults.two_hosts import PULL_TIMEOUT_S, LinkFault, link_fault, start_two_hosts
from faults.netns_hosts import NetnsUnavailable, check_available
from tests.faults.checks import assert_clean

# Past the pull deadline, the proxy's answer and some queueing: a request still unanswered then hangs.
REQUEST_DEADLINE_S = 4 * PULL_TIMEOUT_S


def namespaces_or_skip() -> None:
    try:
        check_available()
    except NetnsUnavailable as exc:
        pytest.skip(f"no network-namespace hosts here: {exc}")


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[FaultStack]:
    namespaces_or_skip()
    with start_two_hosts() as faults:
        yield faults


@pytest.fixture(autouse=True)
def cable_cleared(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "two_hosts" in request.fixturenames:
        request.getfixturevalue("two_hosts").link.clear()


def run(two_hosts: FaultStack, campaign: Campaign, fault: LinkFault, num: int, input_len: tuple[int, int],
        seed: int, concurrency: int | None = None) -> ScenarioResult:
    size = LoadSize(requests=num, concurrency=concurrency or num, deadline_s=REQUEST_DEADLINE_S)
    return link_fault(fault, input_len, output_len=(4, 10))(two_hosts, replace(campaign, size=size, seed=seed))


def assert_all_exact(result: ScenarioResult) -> None:
    assert_clean(result)
    assert (result.tally.ok, result.tally.clear_error) == (result.tally.sent, 0), result.tally.errors
    assert result.recover_s is not None


def test_auto_moves_kv_over_tcp_between_hosts_and_serves_exactly(two_hosts: FaultStack,
                                                                 campaign: Campaign) -> None:
    assert_all_exact(run(two_hosts, campaign, LinkFault("none"), 4, (20, 200), seed=1))
    # Listening on 0.0.0.0, the prefill worker shows the proxy its cable address (--advertise-host).
    record = httpx.get(f"{two_hosts.stack.worker_urls['prefill worker']}/health", timeout=10).json()["worker"]
    assert two_hosts.hosts is not None
    assert (record["host"], record["kv_host"]) == (two_hosts.hosts.a.address,) * 2
    prefill_log = two_hosts.stack.process("prefill worker").tail(100_000)
    assert "KV blocks go over tcp" in prefill_log
    assert "KV blocks go over shm" not in prefill_log


def test_delay_and_loss_on_the_cable_still_serve_exactly(two_hosts: FaultStack, campaign: Campaign) -> None:
    result = run(two_hosts, campaign, LinkFault("delay_loss", delay_ms=20, loss_pct=1.5), 6, (100, 400), seed=2,
                 concurrency=3)
    assert_all_exact(result)


@pytest.mark.slow   # 13 s; a peer lost mid-transfer: tests/transfer/test_failures.py, kills under load: test_faults_2p2d.py
def test_a_cut_while_kv_moves_fails_clearly_frees_blocks_and_recovers(two_hosts: FaultStack,
                                                                      campaign: Campaign) -> None:
    result = run(two_hosts, campaign, LinkFault("cut", cut=True), 4, (1200, 1800), seed=3)
    assert_clean(result)
    assert result.tally.sent == 4
    assert result.tally.clear_error >= 1, result.tally
    assert any("kv_transfer_error" in error for error in result.tally.errors), result.tally.errors
    assert result.recover_s is not None


@pytest.mark.slow
@pytest.mark.parametrize("fault", [LinkFault("delay", delay_ms=20), LinkFault("loss", loss_pct=2),
                                   LinkFault("delay_loss", delay_ms=20, loss_pct=2)], ids=lambda f: f.name)
def test_delay_and_loss_under_load(two_hosts: FaultStack, campaign: Campaign, fault: LinkFault) -> None:
    assert_all_exact(run(two_hosts, campaign, fault, 24, (50, 800), seed=10, concurrency=4))


@pytest.mark.slow
def test_cuts_under_load(two_hosts: FaultStack, campaign: Campaign) -> None:
    for seed in (20, 21, 22):
        result = run(two_hosts, campaign, LinkFault("cut", cut=True), 16, (400, 1800), seed=seed, concurrency=8)
        assert_clean(result)
        assert result.recover_s is not None


# Long enough that the decode's signal plane drops its connection (heartbeats) and its next connect
# attempt meets the cut: the kernel retries that SYN 1, 3, 7, 15 and 31 s after it started, so a
# connect attempt left to those retries waits up to 16 s more once the cable is back (a 12 s cut
# here often ended sooner anyway: the failed ARP entry ends the attempt).
CUT_FOR_S = 30.0
# The recovery the campaign asks for after a cut cable is cleared.
SERVING_WITHIN_S = 5.0


@pytest.mark.slow
def test_the_stack_serves_within_seconds_of_a_long_cut_cleared(two_hosts: FaultStack, campaign: Campaign) -> None:
    assert wait_serving(two_hosts, campaign, timeout_s=60.0) is not None
    two_hosts.link.set(up=False)
    cut_until = time.monotonic() + CUT_FOR_S
    while time.monotonic() < cut_until:   # the fault's length, not a wait for an event
        time.sleep(0.5)
    two_hosts.link.clear()
    cleared = time.monotonic()
    served = wait_serving(two_hosts, campaign, timeout_s=60.0)
    assert served is not None, "the stack did not serve again"
    assert served - cleared < SERVING_WITHIN_S, f"serving again {served - cleared:.1f} s after the cable came back"
