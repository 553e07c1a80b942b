"""The fault campaign's two-host scenarios as the campaign runs them: it builds the two hosts and
the stack itself, runs its load under each cable fault, and judges every call with the same checks
as every other scenario (or reports them skipped, with the reason, where namespaces cannot be made)."""
from __future__ import annotations

import pytest

from faults.campaign import run_campaign
from faults.load import LoadSize
from faults.netns_hosts import NetnsUnavailable, check_available
from tests.faults.checks import assert_clean

LINK_SCENARIOS = ["link_delay_loss_two_hosts", "link_cut_two_hosts"]


@pytest.mark.slow
def test_the_campaign_runs_every_link_fault_on_two_hosts() -> None:
    try:
        check_available()
    except NetnsUnavailable as exc:
        results = run_campaign(LINK_SCENARIOS, LoadSize(requests=8, concurrency=4, deadline_s=40.0))
        assert [r.skipped for r in results] == [str(exc)] * 2
        return
    results = run_campaign(LINK_SCENARIOS, LoadSize(requests=8, concurrency=4, deadline_s=40.0))
    assert [r.name for r in results] == LINK_SCENARIOS
    for result in results:
        assert_clean(result)
        assert result.recover_s is not None
    delay_loss, cut = results
    assert delay_loss.tally.ok == delay_loss.tally.sent == 8, delay_loss.tally
    assert cut.tally.clear_error >= 1, cut.tally
