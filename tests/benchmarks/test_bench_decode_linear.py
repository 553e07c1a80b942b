"""bench_decode_linear: both engines pick the same tokens, and the report says what it measured."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_decode_linear
from stack.serving import ROOT
from worker.model.layers import decode_linear


@pytest.mark.slow
@pytest.mark.skipif(not decode_linear.SUPPORTED, reason="no AMX here (or the kernel was not built)")
def test_quick_run_reports_every_workload(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_decode_linear", "--quick", "--repeats", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"builtin_128_64", "bench24m_512_128", "bench24m_2000_64"}
    for result in report["results"].values():
        assert result["same_tokens"] is True
        assert len(result["runs"]["with"]) == len(result["runs"]["without"]) == 1
    assert "same tokens" in done.stdout and report["repeats"] == 1


def test_refuses_to_run_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_linear, "SUPPORTED", False)
    monkeypatch.setattr(sys, "argv", ["bench_decode_linear", "--quick"])
    with pytest.raises(SystemExit, match="no AMX here"):
        bench_decode_linear.main()
