"""Fault scenarios against one 2P2D stack over a real etcd, started once for the module: each
scenario restarts what it killed, and the proxy must find it again through etcd."""
from __future__ import annotations

from typing import Iterator

import pytest

from faults.judge import Campaign
from faults.scenarios import SCENARIOS
from faults.stacks import FaultStack, start_2p2d
from tests.faults.checks import assert_clean
from tests.faults.conftest import SMALL


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


def test_etcd_killed_mid_load_loses_no_request(stack: FaultStack, campaign: Campaign) -> None:
    result = SCENARIOS["kill_etcd_2p2d"][1](stack, campaign)
    assert_clean(result)
    assert result.tally.ok == result.tally.sent  # the proxy keeps the workers it knew
    assert result.recover_s is not None  # every worker registered again once etcd was back
