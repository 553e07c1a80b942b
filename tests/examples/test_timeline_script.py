"""examples/timeline.py on records as GET /timeline answers them (no servers)."""
from __future__ import annotations

from examples.timeline import format_request, largest_gap, span_table

T = 1000.0
RECORDS = {
    "proxy": {"uid": "u", "source": "proxy", "error": None, "tokens": [T + 0.5, T + 0.52, T + 0.62, T + 0.64],
              "phases": {"received": T, "prefill_sent": T + 0.001, "prefill_answered": T + 0.5,
                         "decode_first": T + 0.51, "done": T + 0.65}},
    "prefill": {"uid": "u", "source": "prefill", "error": None, "tokens": [],
                "phases": {"admitted": T + 0.002, "published": T + 0.49, "push_started": T + 0.491,
                           "push_done": T + 0.495, "released": T + 0.496}},
    "decode": {"uid": "u", "source": "decode", "error": "pull of 'u': slow", "tokens": [],
               "phases": {"admitted": T + 0.003, "pull_started": T + 0.004, "lookup_answered": T + 0.497,
                          "pull_reported": T + 0.6, "first_step": T + 0.605}},
}


def test_a_request_reads_in_time_order_with_its_largest_gap_explained() -> None:
    seconds, index = largest_gap(RECORDS)
    assert abs(seconds - 0.1) < 1e-9 and index == 2
    text = format_request("u", RECORDS)
    lines = text.splitlines()
    assert lines[0] == "request u" and lines[1].split() == ["0.0", "ms", "proxy.received"]
    names = [line.split()[-1] for line in lines[1:15]]
    assert names.index("prefill.published") < names.index("proxy.prefill_answered")
    assert "largest gap 100.0 ms, before token 3, spanning decode.pull_reported, decode.first_step" in text
    assert "error at decode: pull of 'u': slow" in text


def test_span_table_has_each_measured_span() -> None:
    table = span_table({"u": RECORDS})
    assert "decode.pull_report" in table and "prefill.push" in table and "proxy.largest_gap" in table
    row = next(line for line in table.splitlines() if line.startswith("prefill.push "))
    assert row.split()[1:] == ["1", "4.0", "4.0"]
