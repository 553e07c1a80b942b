"""Fixtures of the fault scenarios: the reference outputs (one `both` worker for the session) and
the small load every scenario test drives."""
from __future__ import annotations

from typing import Iterator

import pytest

from faults.judge import Campaign
from faults.load import LoadSize, Reference

SMALL = LoadSize(requests=6, concurrency=3, deadline_s=90.0)


@pytest.fixture(scope="session")
def campaign() -> Iterator[Campaign]:
    with Reference() as reference:
        yield Campaign(SMALL, reference)
