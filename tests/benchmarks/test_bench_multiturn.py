"""bench_serving.py --workload multiturn: the chats it sends, its report, and a short run of both DI stacks."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator

import pytest

from benchmarks import bench_serving
from benchmarks.multiturn_load import MultiturnSpec, chat_messages, make_conversations, run_multiturn, start_offsets
from benchmarks.serving_load import arrival_offsets
from benchmarks.prefix_compare import PrefixRun, format_kv_table, prefix_report
from benchmarks.serving_metrics import RequestResult

from tests.benchmarks.test_bench_serving import run_bench
from tests.worker_process import WorkerProcess


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    started = WorkerProcess("both")
    try:
        yield started
    finally:
        started.stop()


def test_conversations_are_the_same_for_the_same_seed() -> None:
    spec = MultiturnSpec(3, 4, system_chars=50, opening_chars=(20, 30), user_chars=(10, 12), output_len=(2, 5))
    system, conversations = make_conversations(spec)
    assert (system, conversations) == make_conversations(spec)
    assert make_conversations(MultiturnSpec(3, 4, seed=1))[1] != make_conversations(MultiturnSpec(3, 4))[1]
    assert len(conversations) == 3 and all(len(c.user_turns) == 3 and len(c.output_lens) == 4
                                           for c in conversations)
    assert all(2 <= n <= 5 for c in conversations for n in c.output_lens)
    assert all(text.isascii() for c in conversations for text in (c.opening, *c.user_turns))
    with pytest.raises(ValueError, match="at least 1"):
        MultiturnSpec(1, 0)


def test_each_turn_resends_the_last_prompt_and_answer(worker: WorkerProcess) -> None:
    spec = MultiturnSpec(2, 3, system_chars=60, opening_chars=(30, 40), user_chars=(10, 20), output_len=(4, 6))
    results, duration = asyncio.run(run_multiturn(worker.url, "neuron-di-builtin", spec))
    system, conversations = make_conversations(spec)
    assert len(results) == 6 and duration > 0 and all(r.ok for r in results)
    for c, turns in zip(conversations, (results[:3], results[3:])):
        assert [r.output_tokens for r in turns] == list(c.output_lens)
        # The built-in model's tokens are bytes: a prompt grows by the answer's and the user text's bytes (+ BOS).
        prompt = system + c.opening
        for k, r in enumerate(turns):
            if k:
                prompt += turns[k - 1].text + c.user_turns[k - 1]
            assert r.input_tokens == len(prompt.encode()) + 1
    worker.wait_blocks_free()


def test_open_loop_starts_chats_at_the_seeds_poisson_times() -> None:
    assert start_offsets(MultiturnSpec(3, 2)) is None
    spec = MultiturnSpec(5, 2, session_rate=4.0, seed=3)
    offsets, poisson = start_offsets(spec), arrival_offsets(5, 4.0, 3)
    assert offsets == start_offsets(MultiturnSpec(5, 2, session_rate=4.0, seed=3, max_concurrency=9))
    # The Poisson times stretched so that the run's own rate is the one asked for: the last starts at 4 / 4.0 s.
    assert offsets[-1] == pytest.approx(1.0)
    assert [o / offsets[-1] for o in offsets] == pytest.approx([p / poisson[-1] for p in poisson])
    assert start_offsets(MultiturnSpec(1, 2, session_rate=4.0)) == [0.0]
    for bad in ({"session_rate": 0.0}, {"session_rate": -1.0}, {"think_time_s": -0.1}):
        with pytest.raises(ValueError):
            MultiturnSpec(1, 1, **bad)


def test_chat_turns_send_the_same_texts_as_messages(worker: WorkerProcess) -> None:
    spec = MultiturnSpec(2, 3, system_chars=60, opening_chars=(30, 40), user_chars=(10, 20), output_len=(4, 6),
                         api="chat")
    results, _ = asyncio.run(run_multiturn(worker.url, "neuron-di-builtin", spec))
    system, conversations = make_conversations(spec)
    assert len(results) == 6 and all(r.ok for r in results)
    for c, turns in zip(conversations, (results[:3], results[3:])):
        assert [r.output_tokens for r in turns] == list(c.output_lens)
        messages = chat_messages(system, c, [r.text for r in turns[:2]])
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert messages[1]["content"] + "\nassistant:" == c.opening and messages[2]["content"] == turns[0].text
        # The built-in chat template: BOS, each message's role token, bytes and newline, then <|assistant|>.
        assert turns[2].input_tokens == 1 + sum(len(m["content"].encode()) + 2 for m in messages) + 1
    worker.wait_blocks_free()
    with pytest.raises(ValueError, match="api must be one of"):
        MultiturnSpec(1, 1, api="grpc")


def test_open_loop_sends_at_the_start_times_and_waits_the_think_time(worker: WorkerProcess) -> None:
    spec = MultiturnSpec(3, 2, system_chars=40, opening_chars=(20, 30), user_chars=(10, 20), output_len=(3, 4),
                         max_concurrency=1, session_rate=20.0, think_time_s=0.2)
    assert start_offsets(spec)[1] < 0.05      # the second chat starts long before the first one can end
    results, _ = asyncio.run(run_multiturn(worker.url, "neuron-di-builtin", spec))
    assert len(results) == 6 and all(r.ok for r in results)
    # Open loop: the second chat does not wait for the first (a closed loop of max_concurrency 1 would).
    assert results[2].start < results[1].end
    assert all(second.start >= first.end + 0.2 for first, second in zip(results[0::2], results[1::2]))
    worker.wait_blocks_free()


def run(texts: list[str], kv: dict[str, int]) -> PrefixRun:
    return PrefixRun([RequestResult(4, 2, chunk_times=[0.1], text=t) for t in texts], 1.0, kv)


def test_report_divides_bytes_moved_per_request() -> None:
    kv = {"pulls": 4, "blocks_pulled": 8, "blocks_skipped": 24, "bytes_pulled": 800, "bytes_skipped": 2400}
    off = {"pulls": 4, "blocks_pulled": 32, "blocks_skipped": 0, "bytes_pulled": 3200, "bytes_skipped": 0}
    report = prefix_report({"prefix_aware": run(["a", "b"], kv), "full_transfer": run(["a", "b"], off)})
    assert report["kv_bytes_per_request_ratio"] == pytest.approx(0.25)
    assert report["kv_bytes_cut"] == pytest.approx(0.75) and report["same_answers"] is True
    assert report["kv"]["prefix_aware"]["bytes_pulled_per_request"] == 200
    assert "cut 75.0%" in format_kv_table(report)
    differ = prefix_report({"prefix_aware": run(["a", "b"], kv), "full_transfer": run(["a", "c"], off)})
    assert differ["same_answers"] is False
    none = prefix_report({"prefix_aware": run([], {**kv, "pulls": 0}), "full_transfer": run([], off)})
    assert none["kv_bytes_cut"] is None and "cut -" in format_kv_table(none)


def test_bad_command_lines_exit_2() -> None:
    for argv in (["--workload", "multiturn", "--compare"], ["--workload", "multiturn", "--turns", "0"], []):
        with pytest.raises(SystemExit) as exited:
            bench_serving.parse_args(argv)
        assert exited.value.code == 2
    args = bench_serving.parse_args(["--workload", "multiturn", "--quick"])
    assert (args.multiturn.num_conversations, args.multiturn.num_turns, args.multiturn.max_concurrency) == (4, 3, 4)


def check_run(out: Path, requests: int) -> dict:
    report = json.loads(out.read_text())
    for name in ("prefix_aware", "full_transfer"):
        assert (report[name]["completed"], report[name]["failed"]) == (requests, 0)
        assert report[name]["kv"]["pulls"] == requests
    assert report["full_transfer"]["kv"]["blocks_skipped"] == 0
    assert report["prefix_aware"]["kv"]["blocks_skipped"] > 0
    assert report["same_answers"] is True
    assert 0 < report["kv_bytes_per_request_ratio"] < 1
    assert report["config"]["command"].startswith("python -m benchmarks.bench_serving --workload multiturn")
    return report


@pytest.mark.slow  # tests/proxy/test_prefix_1p1d.py runs multi-turn chats over the DI stack by default
def test_two_short_chats_on_both_stacks(tmp_path: Path) -> None:
    out = tmp_path / "multiturn.json"
    done = run_bench("--workload", "multiturn", "--quick", "--conversations", "2", "--turns", "2",
                     "--json", str(out), timeout=240)
    assert done.returncode == 0, done.stderr
    check_run(out, 4)
    assert "KV bytes moved per request, on / off" in done.stdout


@pytest.mark.slow
def test_quick_run_under_a_minute_of_load(tmp_path: Path) -> None:
    out = tmp_path / "multiturn.json"
    done = run_bench("--workload", "multiturn", "--quick", "--json", str(out), timeout=240)
    assert done.returncode == 0, done.stderr
    check_run(out, 12)
