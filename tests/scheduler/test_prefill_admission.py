"""The prefill queue's admission rule, property-tested with plain numbers."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from scheduler.prefill_admission import prefill_room

limits, loads = st.integers(1, 64), st.integers(0, 200)


@given(limits, loads, loads, st.booleans())
def test_room_is_between_zero_and_the_bound(max_jobs: int, jobs: int, engine: int, draining: bool) -> None:
    room = prefill_room(max_jobs, jobs, engine, draining)
    assert 0 <= room <= max_jobs
    assert room + max(jobs, engine) <= max_jobs or room == 0   # never pulls past the bound


@given(limits, loads, loads, st.integers(0, 50))
def test_more_load_never_gives_more_room(max_jobs: int, jobs: int, engine: int, more: int) -> None:
    room = prefill_room(max_jobs, jobs, engine)
    assert prefill_room(max_jobs, jobs + more, engine) <= room
    assert prefill_room(max_jobs, jobs, engine + more) <= room


@given(limits, loads, loads)
def test_a_draining_worker_takes_nothing(max_jobs: int, jobs: int, engine: int) -> None:
    assert prefill_room(max_jobs, jobs, engine, draining=True) == 0


@given(limits)
def test_an_idle_worker_takes_its_bound_and_a_full_one_nothing(max_jobs: int) -> None:
    assert prefill_room(max_jobs, 0, 0) == max_jobs
    assert prefill_room(max_jobs, max_jobs, 0) == 0
    assert prefill_room(max_jobs, 0, max_jobs) == 0


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_jobs"):
        prefill_room(0, 0, 0)
