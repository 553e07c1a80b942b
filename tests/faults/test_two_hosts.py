"""Prefill and decode on two hosts (network namespaces joined by a cable, examples/netns_hosts.py):
`auto` moves KV over tcp between them, answers equal a single `both` worker's, and faults on
the cable (delay, loss, a cut while KV moves) end every request exactly or with a clear error,
with no request left hanging and no KV block left in use.
"""
from __future__ import annotations

import sys
from typing import Iterator

import httpx
import pytest

from tests.helpers import ROOT

# The example modules import their siblings by name, as they do when run as scripts.
sys.path.insert(0, str(ROOT / "examples"))

from netns_faults import (FaultCounts, LinkFault, TwoHostStack, run_fault,  # noqa: E402
                          start_two_host_di)
from netns_hosts import NetnsUnavailable, TwoHosts, check_available  # noqa: E402
from serving_load import LoadSpec  # noqa: E402
from serving_stack import StackOptions  # noqa: E402

# Short, so a cut ends requests soon; long enough that prefills queued behind each other under the
# loads below never run past it.
PULL_TIMEOUT_S = 10.0
OPTIONS = StackOptions(kv_transport="auto")
DI_FLAGS = ["--kv-pull-timeout", f"{PULL_TIMEOUT_S:g}", "--kv-abort-timeout", f"{2 * PULL_TIMEOUT_S:g}"]
# Past the pull deadline, the proxy's answer and some queueing: a request still unanswered then hangs.
REQUEST_DEADLINE_S = 4 * PULL_TIMEOUT_S


def namespaces_or_skip() -> None:
    try:
        check_available()
    except NetnsUnavailable as exc:
        pytest.skip(f"no network-namespace hosts here: {exc}")


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[TwoHostStack]:
    namespaces_or_skip()
    with TwoHosts() as hosts:
        two = start_two_host_di(hosts, OPTIONS, DI_FLAGS)
        with two.stack:
            yield two


@pytest.fixture(autouse=True)
def cable_cleared(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "two_hosts" in request.fixturenames:
        request.getfixturevalue("two_hosts").hosts.link.clear()


def load(num: int, input_len: tuple[int, int], seed: int, concurrency: int | None = None) -> LoadSpec:
    return LoadSpec(num_prompts=num, input_len=input_len, output_len=(4, 10), max_concurrency=concurrency,
                    seed=seed, request_timeout_s=REQUEST_DEADLINE_S)


def assert_all_exact(counts: FaultCounts) -> None:
    assert (counts.ok, counts.clear_error, counts.hung, counts.wrong) == (counts.sent, 0, 0, 0), counts.errors
    assert counts.blocks_leaked == 0
    assert counts.recover_s is not None


def test_auto_moves_kv_over_tcp_between_hosts_and_serves_exactly(two_hosts: TwoHostStack) -> None:
    counts = run_fault(two_hosts, LinkFault("none"), load(4, (20, 200), seed=1))
    assert_all_exact(counts)
    # Listening on 0.0.0.0, the prefill worker shows the proxy its cable address (--advertise-host).
    record = httpx.get(f"{two_hosts.worker_urls['prefill worker']}/health", timeout=10).json()["worker"]
    assert (record["host"], record["kv_host"]) == (two_hosts.hosts.a.address,) * 2
    prefill_log = next(p for p in two_hosts.stack.processes if p.name == "prefill worker").tail(100_000)
    assert "KV blocks go over tcp" in prefill_log
    assert "KV blocks go over shm" not in prefill_log


def test_delay_and_loss_on_the_cable_still_serve_exactly(two_hosts: TwoHostStack) -> None:
    counts = run_fault(two_hosts, LinkFault("delay+loss", delay_ms=20, loss_pct=1.5),
                       load(6, (100, 400), seed=2, concurrency=3))
    assert_all_exact(counts)


def test_a_cut_while_kv_moves_fails_clearly_frees_blocks_and_recovers(two_hosts: TwoHostStack) -> None:
    counts = run_fault(two_hosts, LinkFault("cut", cut=True), load(4, (1200, 1800), seed=3))
    assert counts.sent == 4
    assert counts.hung == counts.wrong == 0, counts.errors
    assert counts.clear_error >= 1, counts
    assert any("kv_transfer_error" in error for error in counts.errors), counts.errors
    assert counts.blocks_leaked == 0
    assert counts.recover_s is not None


@pytest.mark.slow
@pytest.mark.parametrize("fault", [LinkFault("delay", delay_ms=20), LinkFault("loss", loss_pct=2),
                                   LinkFault("delay+loss", delay_ms=20, loss_pct=2)], ids=lambda f: f.name)
def test_delay_and_loss_under_load(two_hosts: TwoHostStack, fault: LinkFault) -> None:
    assert_all_exact(run_fault(two_hosts, fault, load(24, (50, 800), seed=10, concurrency=4)))


@pytest.mark.slow
def test_cuts_under_load(two_hosts: TwoHostStack) -> None:
    for seed in (20, 21, 22):
        counts = run_fault(two_hosts, LinkFault("cut", cut=True), load(16, (400, 1800), seed=seed, concurrency=8))
        assert counts.hung == counts.wrong == counts.blocks_leaked == 0, counts
        assert counts.ok + counts.clear_error == counts.sent
        assert counts.recover_s is not None
