"""The KV integrity check (on by default) end to end: checked pulls answer exactly as
unchecked ones (--no-kv-integrity-check), and a corrupted push fails its request with a KV
transfer error, its blocks freed on both sides."""
from __future__ import annotations

import asyncio
import time
from typing import Iterator

import pytest
import torch

from common.handoff import parse_leg
import worker.engine.kv_connector as kv_connector_module
from tests.di.test_engine_pair import run_pair, wait_all_free
from tests.di.test_parity import body, pair_answers, prompts
from stack.serving import free_port
from tests.neuron_connector.kv import corrupting_engine
from tests.worker_process import start_workers, stop_together
from worker import EngineConfig, KVTransferError, LLMEngine, SamplingParams
from worker.engine.kv_connector import KVConnector, KVConnectorConfig

NUM_BLOCKS = 128


def test_checked_pulls_answer_as_unchecked_ones_and_count_no_failure() -> None:
    prefill, plain, checked = start_workers(("prefill", "shm", ()), ("decode", "shm", ["--no-kv-integrity-check"]),
                                            ("decode", "shm", ()))
    try:
        bodies = [body(p) for p in prompts()[::5]]             # 10 prompts, 1 to ~900 tokens
        want = asyncio.run(pair_answers(prefill, plain, bodies, concurrency=4))
        got = asyncio.run(pair_answers(prefill, checked, bodies, concurrency=4))
        assert got == want
        assert checked.metric("neuron_di_kv_integrity_checks_total") == len(bodies)
        assert checked.metric("neuron_di_kv_integrity_failures_total") == 0
        assert plain.metric("neuron_di_kv_integrity_checks_total") == 0
        for worker in (prefill, plain, checked):
            worker.wait_blocks_free()
    finally:
        stop_together(plain, checked, prefill)


@pytest.fixture
def corrupting_pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LLMEngine, LLMEngine, list[bool]]]:
    """Two engines in this process; the prefill's first push lands with one byte flipped."""
    torch.set_num_threads(1)
    with monkeypatch.context() as patch:
        patch.setattr(kv_connector_module, "create_transfer_engine",
                      lambda transport, host, secret: corrupting_engine(1))
        prefill = LLMEngine(EngineConfig(role="prefill", num_kv_blocks=NUM_BLOCKS),
                            kv_connector=KVConnector(KVConnectorConfig("prefill", "shm", kv_port=free_port())))
    checks: list[bool] = []
    try:
        decode = LLMEngine(EngineConfig(role="decode", num_kv_blocks=NUM_BLOCKS), kv_connector=KVConnector(
            KVConnectorConfig("decode", "shm", engine_id="decode-checked", integrity_check=True)))
    except BaseException:
        prefill.close()
        raise
    decode.kv_connector.on_integrity_check = checks.append
    try:
        yield prefill, decode, checks
    finally:
        decode.close()
        prefill.close()


def test_a_corrupted_push_fails_the_request_and_frees_its_blocks(corrupting_pair) -> None:
    prefill, decode, checks = corrupting_pair
    rid, prompt = "corrupted", [(5 * i) % 200 + 30 for i in range(70)]
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1), parse_leg({"role": "prefill"}))
    decode.add_request(rid, prompt, SamplingParams(max_tokens=4), parse_leg({
        "role": "decode", "remote_host": "127.0.0.1", "remote_port": prefill.kv_connector.kv_port}))
    deadline, failed = time.monotonic() + 30, None
    while failed is None:
        assert time.monotonic() < deadline, "the corrupted pull never ended"
        prefill.step()
        failed = next((o for o in decode.step() if o.request_id == rid), None)
    assert failed.finished and failed.finish_reason == "error", failed
    # The error a failed transfer gives (kv_transfer_error, 503 over HTTP), naming the peer and request.
    assert isinstance(failed.error, KVTransferError) and failed.error.retryable
    assert (f"KV transfer of request {rid!r} from the prefill worker failed: KV blocks of {rid!r} from prefill "
            f"peer 127.0.0.1:{prefill.kv_connector.kv_port} are corrupt") in str(failed.error)
    wait_all_free(prefill, decode)
    assert checks == [False]
    # The next push arrives intact: checked, and the same tokens as one engine computes.
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]
    want = LLMEngine(EngineConfig(num_kv_blocks=NUM_BLOCKS)).generate([prompt], params)
    _, got = run_pair(prefill, decode, [prompt], params, tag="intact")
    assert got == want and checks == [False, True]
    wait_all_free(prefill, decode)
