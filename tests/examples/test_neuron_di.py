"""examples/neuron_di.py end to end (real workers, proxy and engine) and its report, sans I/O."""
from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from benchmarks.di_stats import Completion, blocks_for, diverging_at, first_mismatch, format_summary, summarize, transfer_time
from examples.neuron_di import PROMPTS, encode_prompts
from tests.script_runs import interrupted_run, listening, needs_di, run_script, stack_ports
from worker.model.loader import BUILTIN_MODEL_NOTE, builtin_model_path, load_config


def test_first_mismatch_finds_the_first_differing_output():
    a, b = Completion(3, "abc"), Completion(3, "abd")
    assert first_mismatch([a, a], [a, a]) is None
    mismatch = first_mismatch([a, a, a], [a, b, Completion(2, "ab")])
    assert mismatch is not None and mismatch.index == 1 and mismatch.got == b
    assert first_mismatch([a], [Completion(4, "abc")]).index == 0  # same text, different token count
    with pytest.raises(ValueError, match="2 reference outputs but 1 DI outputs"):
        first_mismatch([a, a], [a])


def test_diverging_at():
    assert diverging_at("abcdef", "abXdef") == 2
    assert diverging_at("abc", "abcdef") == 3


def test_blocks_cover_the_prompt_with_a_partial_last_block():
    assert [blocks_for(n, 16) for n in (1, 15, 16, 17, 32, 33)] == [1, 1, 1, 2, 2, 3]


def _metrics_text(name: str, seconds: list[float]) -> str:
    registry = CollectorRegistry()
    histogram = Histogram(name, "KV transfer time.", ["model_name"], registry=registry)
    for s in seconds:
        histogram.labels("m").observe(s)
    return generate_latest(registry).decode()


def test_transfer_time_read_from_a_prometheus_histogram():
    seconds, count = transfer_time(_metrics_text("neuron_di_kv_transfer_seconds", [0.25, 0.5, 0.25]))
    assert (seconds, count) == (1.0, 3)
    assert transfer_time(_metrics_text("neuron_di_ttft_seconds", [0.25])) == (None, None)


def test_summary_without_and_with_transfer_time():
    summary = summarize([1, 16, 17], block_size=16, block_bytes=1000, metrics_text="")
    assert (summary.num_requests, summary.num_blocks, summary.num_bytes) == (3, 4, 4000)
    assert summary.gb_per_s is None and "not reported" in format_summary(summary, 1000)
    timed = summarize([32], 16, 10**6, _metrics_text("neuron_di_kv_transfer_seconds", [0.001]))
    assert timed.gb_per_s == pytest.approx(2.0) and timed.ms_per_transfer == pytest.approx(1.0)
    shown = format_summary(timed, 10**6)
    assert "2.000 GB/s (transfers of 2.00 MB: their fixed cost, not bandwidth, sets this;" in shown
    large = summarize([16 * 2**10], 16, 2**20, _metrics_text("neuron_di_kv_transfer_seconds", [0.1]))
    assert format_summary(large, 2**20).endswith(f"{large.gb_per_s:.3f} GB/s")


@needs_di
@pytest.mark.parametrize("transport", ["shm", pytest.param("tcp", marks=pytest.mark.slow)])
def test_neuron_di_outputs_match_the_non_disaggregated_run(transport):
    result = run_script("examples/neuron_di.py", "--num-prompts", "3", "--max-tokens", "8", "--concurrency", "2",
                            "--kv-transport", transport)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "outputs match: 3 prompts" in result.stdout
    assert result.stdout.count("8 tokens generated") == 3
    assert result.stdout.index(BUILTIN_MODEL_NOTE) < result.stdout.index("=== prompt 0")  # said before its text
    # Whole 16-token float32 blocks of every layer's K and V, for each prompt as the example encodes it.
    config = load_config(builtin_model_path())
    block_bytes = config.num_hidden_layers * 2 * 16 * config.num_key_value_heads * config.head_dim * 4
    blocks = sum(-(-len(p) // 16) for p in encode_prompts(None, PROMPTS[:3]))
    assert re.search(rf"blocks moved +{blocks} \({blocks / 3:.1f} per request\)", result.stdout)
    assert re.search(rf"bytes moved +{blocks * block_bytes:,} ", result.stdout)
    assert re.search(r"time per request +\d+ ms mean end to end \(2 in flight\)", result.stdout)
    # The prefill worker timed every push: 3 transfers, reported with a rate.
    assert re.search(r"transfer time +[\d.]+ ms total, [\d.]+ ms per transfer", result.stdout)
    assert "GB/s" in result.stdout and "not reported" not in result.stdout


def test_bad_arguments_exit_2_before_starting_anything():
    result = run_script("examples/neuron_di.py", "--max-tokens", "0")
    assert result.returncode == 2 and "must be at least 1, got 0" in result.stderr


@needs_di
@pytest.mark.slow   # 8 s; Ctrl-C stopping every process of a running stack: tests/examples/test_launchers.py
def test_ctrl_c_during_generation_stops_every_process(tmp_path):
    status, out = interrupted_run(tmp_path / "neuron_di.log", "examples/neuron_di.py", "--max-tokens", "400",
                                  "--concurrency", "1", marker="DI generate")
    assert status == 130, out
    assert "interrupted; every process was stopped" in out
    assert not any(listening(port) for port in stack_ports(out))
