"""Fault scenarios against one static 1P1D stack (prefill, decode, proxy), started once for the module:
each scenario leaves it as it found it (a killed process is restarted)."""
from __future__ import annotations

from typing import Iterator

import pytest

from faults.inputs import HTTP_CASES, ZMQ_BAD_FRAMES
from faults.judge import Campaign
from faults.scenarios import SCENARIOS
from faults.stacks import ABORT_TIMEOUT_S, FaultStack, start_1p1d
from tests.faults.checks import assert_clean
from tests.faults.conftest import SMALL


@pytest.fixture(scope="module")
def stack() -> Iterator[FaultStack]:
    with start_1p1d() as faults:
        yield faults


# By default the proxy: tests/proxy/test_flow_failures.py kills workers mid-request, tests/di/test_restart.py
# restarts them.
@pytest.mark.parametrize("kind", [pytest.param("prefill", marks=pytest.mark.slow),
                                  pytest.param("decode", marks=pytest.mark.slow), "proxy"])
def test_kill_mid_load_then_restart_serves_again(stack: FaultStack, campaign: Campaign, kind: str) -> None:
    result = SCENARIOS[f"kill_{kind}_1p1d"][1](stack, campaign)
    assert_clean(result)
    assert result.recover_s is not None
    assert result.tally.ok >= SMALL.requests  # at least the load after the restart got through whole


def test_clients_leaving_early_free_every_block_by_abort(stack: FaultStack, campaign: Campaign) -> None:
    result = SCENARIOS["client_disconnect_1p1d"][1](stack, campaign)
    assert_clean(result)
    assert result.tally.clear_error == 0
    # Freed when the requests were aborted, not by the prefill's abort timeout.
    assert result.abandoned_free_s is not None and result.abandoned_free_s < ABORT_TIMEOUT_S


def test_malformed_http_is_refused_clearly_under_load(stack: FaultStack, campaign: Campaign) -> None:
    result = SCENARIOS["malformed_http_1p1d"][1](stack, campaign)
    assert_clean(result)
    assert result.tally.clear_error == 3 * len(HTTP_CASES)  # at the proxy and at both workers
    assert result.tally.ok == SMALL.requests


def test_malformed_zmq_frames_are_refused_clearly_under_load(stack: FaultStack, campaign: Campaign) -> None:
    result = SCENARIOS["malformed_zmq_1p1d"][1](stack, campaign)
    assert_clean(result)
    assert result.tally.clear_error == len(ZMQ_BAD_FRAMES)
    assert result.tally.ok == SMALL.requests + 1  # the load, and a handshake after all the junk


@pytest.mark.slow
def test_slow_streaming_readers_get_whole_answers(stack: FaultStack, campaign: Campaign) -> None:
    result = SCENARIOS["slow_client_1p1d"][1](stack, campaign)
    assert_clean(result)
    assert result.tally.ok == result.tally.sent
