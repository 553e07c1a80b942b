"""Fixtures of the fault scenarios: the reference outputs (one `both` worker for the session) and
the small load every scenario test drives."""
from __future__ import annotations

import sys
from typing import Iterator

import pytest

from tests.helpers import ROOT

# The scenarios are examples/ modules that import their siblings by name, as examples/fault_campaign.py does.
sys.path.insert(0, str(ROOT / "examples"))

from fault_load import LoadSize, Reference  # noqa: E402
from fault_judge import Campaign  # noqa: E402

SMALL = LoadSize(requests=6, concurrency=3, deadline_s=90.0)


@pytest.fixture(scope="session")
def campaign() -> Iterator[Campaign]:
    with Reference() as reference:
        yield Campaign(SMALL, reference)
