"""faults/campaign.py: its table and exit status, and (behind --full) its whole default run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from faults import campaign as fault_campaign
from faults.judge import ScenarioResult
from faults.load import Tally
from faults.scenarios import SCENARIOS
from tests.script_runs import script_env
from tests.helpers import ROOT


def test_table_has_a_row_per_scenario_and_lists_every_problem() -> None:
    clean = ScenarioResult("kill_decode_1p1d", "1p1d", Tally(sent=10, ok=7, clear_error=3), {"decode worker": 0},
                           recover_s=4.5, fault_blocks_free_s=1.25, recovered=True)
    leaky = ScenarioResult("client_disconnect_1p1d", "1p1d", Tally(sent=4, ok=3, hung=1, problems=["no answer"]),
                           {"prefill worker": 2}, abandoned_free_s=0.25)
    lines = fault_campaign.format_table([clean, leaky]).splitlines()
    assert lines[0].split()[:3] == ["scenario", "sent", "ok"]
    assert lines[1].split() == ["kill_decode_1p1d", "10", "7", "3", "0", "0", "0", "0", "1.25", "4.50", "-"]
    assert lines[2].split() == ["client_disconnect_1p1d", "4", "3", "0", "1", "0", "0", "2", "-", "-", "0.25"]
    assert lines[3:] == ["  client_disconnect_1p1d: no answer",
                         "  client_disconnect_1p1d: prefill worker holds 2 KV blocks after the load stopped"]
    assert clean.passed and not leaky.passed


def test_a_drain_that_fails_a_request_or_exits_badly_does_not_pass() -> None:
    def drain(tally: Tally, status: int) -> ScenarioResult:
        return ScenarioResult("drain_decode_2p2d", "2p2d", tally, {"decode worker 1": 0}, planned=True,
                              exit_status=status, recovered=True)
    assert drain(Tally(sent=10, ok=10), 0).passed
    assert not drain(Tally(sent=10, ok=9, clear_error=1), 0).passed   # a kill may fail a request; a drain not
    assert not drain(Tally(sent=10, ok=10), 1).passed


def test_skipped_scenario_shows_its_reason_and_does_not_fail() -> None:
    skipped = ScenarioResult("link_cut_two_hosts", "two_hosts", skipped="network namespaces need root")
    lines = fault_campaign.format_table([skipped]).splitlines()
    assert lines[1].split() == ["link_cut_two_hosts", "skipped", *["-"] * (len(fault_campaign.COLUMNS) - 2)]
    assert lines[2:] == ["  link_cut_two_hosts: skipped: network namespaces need root"]
    assert skipped.passed


def test_link_faults_are_scenarios_of_the_campaign() -> None:
    args = fault_campaign.parse_args(["--scenario", "link_cut_two_hosts"])
    assert args.scenario == ["link_cut_two_hosts"]
    assert {name: topology for name, (topology, _) in SCENARIOS.items() if name.startswith("link_")} == {
        "link_delay_loss_two_hosts": "two_hosts", "link_cut_two_hosts": "two_hosts"}


def test_unknown_scenario_is_refused() -> None:
    with pytest.raises(SystemExit):
        fault_campaign.parse_args(["--scenario", "kill_everything"])


@pytest.mark.slow
@pytest.mark.timeout(60 * 60)
def test_full_campaign_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "campaign.json"
    done = subprocess.run([sys.executable, "-m", "faults.campaign", "--json", str(out)], cwd=ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=55 * 60)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert [r["name"] for r in results] == list(SCENARIOS)
    assert all(r["passed"] for r in results)
