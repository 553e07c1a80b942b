"""benchmarks/soak.py: a short run against a real 1P1D stack in CI, the 30-minute one behind --full."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import soak
from tests.script_runs import script_env
from tests.helpers import ROOT


def run_soak(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = Path(args[args.index("--json") + 1])
    done = subprocess.run([sys.executable, "-m", "benchmarks.soak", *args], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=timeout)
    return done, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.slow   # a load run (13 s); blocks back to zero after load is asserted by the fault and stream tests too
def test_quick_soak_loses_nothing_and_frees_every_block(tmp_path: Path) -> None:
    # A short run's RSS still grows (warm-up), so the memory verdict is not asked of it here.
    done, report = run_soak("--quick", "--minutes", "0.1", "--warmup-minutes", "0.05", "--rss-tolerance-mb", "100000",
                            "--json", str(tmp_path / "s.json"), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = report["summary"]
    assert summary["sent"] == 8 * summary["rounds"] and summary["failed"] == 0
    assert summary["blocks_used_at_end"] == {"prefill worker": 0, "decode worker": 0}
    assert set(summary["rss_mb"]) == {"prefill worker", "decode worker", "proxy"}
    assert "RSS flat after warm-up" in done.stdout


def test_rss_verdict_counts_growth_after_warm_up_only() -> None:
    args = argparse.Namespace(warmup_minutes=5.0, rss_tolerance_mb=50.0)
    samples = [soak.Sample(i, minutes, 10 * i, 0, {"w": rss}, {"w": 0})
               for i, (minutes, rss) in enumerate([(0, 600), (4, 900), (5, 1000), (30, 1040)])]
    summary = soak.summarize(samples, {"w": 0}, args)
    assert summary["rss_mb"]["w"] == {"start": 600, "after_warmup": 1000, "end": 1040, "growth_after_warmup": 40}
    assert summary["rss_flat"] and summary["warmup_ends_at_round"] == 2
    samples.append(soak.Sample(4, 31, 40, 0, {"w": 1051}, {"w": 0}))
    assert not soak.summarize(samples, {"w": 0}, args)["rss_flat"]


@pytest.mark.slow
@pytest.mark.timeout(50 * 60)
def test_thirty_minute_soak_keeps_memory_flat(tmp_path: Path) -> None:
    done, report = run_soak("--json", str(tmp_path / "soak.json"), timeout=45 * 60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["summary"]["failed"] == 0 and report["summary"]["rss_flat"]
