"""The simulated engine (`--engine mock`): its cost model, its tokens, and the worker around it.

Its tokens come from the KV its pool holds, so a mock 1P1D stack behind the proxy answers exactly as a mock
`both` worker only when the KV moved intact (real processes, real KV transfers of the tiny layout).
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from scheduler import ScheduledChunk, ScheduledStep, Sequence
from stack.serving import Process, free_port, wait_healthy
from stack.worker_metrics import metric_sum, wait_blocks_free
from tests.helpers import ROOT, wait_until
from tests.worker_process import WorkerProcess
from worker.config import EngineConfig
from worker.engine.llm_engine import LLMEngine
from worker.mock.cost_model import CostModel
from worker.mock.model import MockModel
from worker.sampling_params import SamplingParams

MOCK = ["--engine", "mock", "--threads", "1", "--mock-decode-base-ms", "5"]


def test_a_step_costs_its_prompt_tokens_and_its_decodes() -> None:
    cost = CostModel(prefill_tokens_per_s=1000.0, decode_base_s=0.01, decode_per_seq_s=0.002)
    prompt, running = Sequence("a", [1] * 300, 4), Sequence("b", [1] * 10, 4)
    running.token_ids.append(5)   # one output token: its next chunk is a decode
    step = ScheduledStep([ScheduledChunk(running, 10, 1), ScheduledChunk(prompt, 0, 200)])
    assert cost.step_seconds(step) == pytest.approx(0.2 + 0.01 + 0.002)


def test_the_cost_model_is_calibrated_from_a_bench_engine_report(tmp_path: Path) -> None:
    cost = CostModel.from_bench_engine(ROOT / "benchmarks" / "results" / "engine_bench24m.json")
    assert cost.prefill_tokens_per_s == pytest.approx(1855.2, abs=0.1)
    assert cost.decode_base_s + cost.decode_per_seq_s == pytest.approx(1 / 100.7356, rel=1e-3)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="bad.json is not a bench_engine report"):
        CostModel.from_bench_engine(bad)


def test_tokens_are_deterministic_printable_and_run_to_max_tokens() -> None:
    model = MockModel.load(None, CostModel(decode_base_s=0.0, decode_per_seq_s=1e-6, prefill_tokens_per_s=1e9))
    engine = LLMEngine(model.with_real_capacity(EngineConfig()), model=model)
    # the built-in model's capacity in the default 256 MiB: 4 layers, 2 KV heads of 64 floats, 16 a block
    assert engine.kv_layout.num_blocks == 256 * 2**20 // (2 * 4 * 16 * 2 * 64 * 4)
    prompts = [[72, 105] * 40, [65] * 7, [72, 105] * 40]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert outputs[0] == outputs[2] != outputs[1]
    assert all(len(o) == 24 and all(32 <= t < 127 for t in o) for o in outputs)
    assert 0 < engine.counters.prefill_tokens <= 167 and engine.counters.decode_seqs == 3 * 23


def test_each_token_is_certain_where_logprobs_are_asked_for() -> None:
    model = MockModel.load(None, CostModel(decode_base_s=0.0, decode_per_seq_s=1e-6, prefill_tokens_per_s=1e9))
    engine = LLMEngine(EngineConfig(num_kv_blocks=64), model=model)
    engine.add_request("top", [72, 105] * 8, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    engine.add_request("none", [72, 105] * 8, SamplingParams(max_tokens=4, temperature=0.0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    top = [(o.new_token_ids[0], o.logprobs) for o in outputs if o.request_id == "top"]
    assert len(top) == 4 and all(lp is not None and [(e.token_id, e.logprob, e.rank, e.top) for e in lp] ==
                                 [(t, 0.0, 1, ((t, 0.0),))] for t, lp in top)
    assert all(o.logprobs is None for o in outputs if o.request_id == "none")


@pytest.mark.parametrize("argv, message", [
    (["--mock-decode-base-ms", "5"], "the --mock-* flags need --engine mock"),
    (["--engine", "mock", "--mock-prefill-tokens-per-s", "0"], "prefill tokens per second must be positive"),
    (["--engine", "mock", "--mock-calibration", "/nonexistent.json"], "/nonexistent.json is not a bench_engine"),
])
def test_bad_mock_flags_stop_the_worker_naming_them(argv: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "worker", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and message in done.stderr


@pytest.fixture(scope="module")
def mock_stack() -> Iterator[tuple[str, str, dict[str, str]]]:
    """A mock `both` worker, and a mock 1P1D pair behind the proxy: (both URL, proxy URL, worker URLs)."""
    ports = {name: free_port() for name in ("both", "prefill", "decode", "proxy")}
    kv_port = free_port()
    processes = [Process(f"mock-{role}", ["-m", "worker", "--role", role, "--port", str(ports[role]),
                                          "--kv-transport", "shm", *(["--kv-port", str(kv_port)] if role == "prefill"
                                                                     else []), *MOCK])
                 for role in ("both", "prefill", "decode")]
    urls = {role: f"http://127.0.0.1:{ports[role]}" for role in ports}
    try:
        for role in ("both", "prefill", "decode"):
            wait_healthy(f"{urls[role]}/health", processes, 90)
        processes.append(Process("proxy", ["proxy_server.py", "--port", str(ports["proxy"]),
                                           "--prefill-ip", "127.0.0.1", "--prefill-port", str(ports["prefill"]),
                                           "--decode-ip", "127.0.0.1", "--decode-port", str(ports["decode"])]))
        wait_healthy(f"{urls['proxy']}/ready", processes, 60)
        yield urls["both"], urls["proxy"], {r: urls[r] for r in ("prefill", "decode")}
    finally:
        for process in reversed(processes):
            process.stop()


def test_a_mock_1p1d_stack_answers_as_one_mock_worker(mock_stack: tuple[str, str, dict[str, str]]) -> None:
    both, proxy, workers = mock_stack
    for i, prompt in enumerate(["def add(a, b):", "x" * 300, "a longer prompt " * 40]):
        body = {"model": "neuron-di-builtin", "prompt": prompt, "max_tokens": 12 + i, "temperature": 0.0,
                "stream": i == 1}
        want = httpx.post(f"{both}/v1/completions", json={**body, "stream": False}, timeout=60).json()
        got = httpx.post(f"{proxy}/v1/completions", json=body, timeout=60)
        text = ("".join(json.loads(line[5:])["choices"][0]["text"] for line in got.text.splitlines()
                        if line.startswith("data:") and line != "data: [DONE]") if i == 1
                else got.json()["choices"][0]["text"])
        assert text == want["choices"][0]["text"] and len(text) == 12 + i
    assert metric_sum(workers["decode"], "neuron_di_kv_pulls_total") == 3   # every answer's KV was pulled
    assert not any(wait_blocks_free(workers, 30).values())


def test_a_request_is_counted_as_it_arrives_not_once_the_engine_admits_it() -> None:
    """The engine admits requests between steps. One that arrives during a long prefill step is in the prompt
    tokens a planner reads before that step ends (its first token), not seconds later."""
    worker = WorkerProcess("both", extra=[*MOCK, "--mock-prefill-tokens-per-s", "25"])   # 50 tokens: a 2 s step
    tokens = lambda name: metric_sum(worker.url, f"neuron_di_{name}_tokens_total")   # noqa: E731
    body = {"model": "neuron-di-builtin", "max_tokens": 1, "temperature": 0.0}
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{worker.url}/v1/completions", json={**body, "prompt": [65] * 50},
                                timeout=60)
            wait_until(lambda: tokens("prompt") == 50, what="the first request counted")
            second = pool.submit(httpx.post, f"{worker.url}/v1/completions", json={**body, "prompt": [66] * 5},
                                 timeout=60)
            wait_until(lambda: tokens("prompt") == 55, what="the second request counted")
            assert tokens("generation") == 0   # the first one's prefill step still runs
            assert first.result().status_code == second.result().status_code == 200
        assert tokens("generation") == 2
    finally:
        worker.stop()
