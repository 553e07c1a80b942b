"""run_link_faults, the entry point a fault campaign calls: it builds the two hosts and the stack
itself, runs a load under each fault, and counts how every request ended."""
from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "examples"))

from netns_faults import LinkFault, run_link_faults  # noqa: E402
from netns_hosts import NetnsUnavailable, check_available  # noqa: E402
from serving_load import LoadSpec  # noqa: E402


@pytest.mark.slow
def test_run_link_faults_counts_every_request_of_every_fault() -> None:
    try:
        check_available()
    except NetnsUnavailable as exc:
        pytest.skip(f"no network-namespace hosts here: {exc}")
    spec = LoadSpec(num_prompts=8, input_len=(200, 1500), output_len=(4, 8), max_concurrency=4,
                    request_timeout_s=40.0)
    counts = run_link_faults(spec, [LinkFault("delay+loss", delay_ms=20, loss_pct=1), LinkFault("cut", cut=True)],
                             pull_timeout_s=10.0)
    assert [c.fault for c in counts] == ["delay+loss", "cut"]
    for c in counts:
        assert c.sent == c.ok + c.clear_error + c.hung + c.wrong == spec.num_prompts, c
        assert c.hung == c.wrong == c.blocks_leaked == 0, c
        assert c.recover_s is not None
    assert counts[0].ok == spec.num_prompts, counts[0]
    assert counts[1].clear_error >= 1, counts[1]
