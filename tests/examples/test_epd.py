"""examples/epd.py end to end: a real EPD stack and a `both` worker, answers compared, a table printed."""
from __future__ import annotations

import pytest

from tests.script_runs import run_script


@pytest.mark.slow  # tests/encode/test_epd_stack.py runs the same requests on the same stack by default
def test_epd_example_runs_and_its_answers_equal_the_both_workers() -> None:
    result = run_script("examples/epd.py", "--images", "2", "--requests", "3", "--concurrency", "3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "images/request  requests  equal" in result.stdout
    assert "             2         3      3  " in result.stdout
    assert "EPD answers equal the both worker's" in result.stdout
