"""The Mooncake trace reader and prompt builder of the KV-routing benchmark, with plain lines."""
from __future__ import annotations

import pytest

from benchmarks.mooncake_trace import read_trace, synthetic_trace, trace_lines, trace_prompt

LINES = ['{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49, 50]}',
         '', '{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [46, 47, 99]}']


def test_rows_are_read_in_time_order_and_shared_ids_share_a_prefix() -> None:
    first, second = read_trace(LINES)
    assert (first.timestamp_ms, second.input_length, second.hash_ids[:2]) == (0, 6955, (46, 47))
    a, b = trace_prompt(first, 512, scale=8), trace_prompt(second, 512, scale=8)
    assert (len(a), len(b)) == (1100 // 8, 6955 // 8)
    assert a[:128] == b[:128] and a[128:] != b[128:137]   # blocks 46 and 47 (64 tokens each at scale 8)


@pytest.mark.parametrize("line", ["nope", '{"timestamp": 1}', '{"timestamp": 1, "input_length": 0, '
                                  '"output_length": 1, "hash_ids": []}'])
def test_a_bad_line_is_named(line: str) -> None:
    with pytest.raises(ValueError, match="line 1"):
        read_trace([line])


def test_synthetic_trace_round_trips_through_the_format() -> None:
    rows = synthetic_trace(20, 2.0, 3, 2, (2, 4), 16, seed=1)
    assert read_trace(trace_lines(rows)) == rows
    assert len({r.hash_ids[:2] for r in rows}) <= 3
