"""Disaggregation in bfloat16: the pair answers as one bf16 `both` engine, and a bf16 and an fp32 engine
refuse each other's KV at the handshake."""
from __future__ import annotations

import time
from typing import Iterator

import pytest

from common.handoff import parse_leg
from tests.di.engine_pair import engine_trio, run_pair, wait_all_free
from worker import LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    with engine_trio(256, dtype="bfloat16") as trio:
        yield trio


def test_bf16_pair_token_ids_equal_both(engines) -> None:
    prefill, decode, both = engines
    assert [e.kv_layout.dtype for e in engines] == ["bfloat16"] * 3
    assert {str(p.dtype) for e in engines for p in e.runner.model.parameters()} == {"torch.bfloat16"}
    prompts = [[(7 * i + j) % 200 + 30 for j in range(n)] for i, n in enumerate([1, 16, 17, 100, 333, 700])]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0) for _ in prompts]
    params += [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=20 + i) for i in range(len(prompts))]
    prompts += prompts
    want = both.generate(prompts, params)
    first, got = run_pair(prefill, decode, prompts, params)
    assert got == want
    assert first == [w[0] for w in want]
    wait_all_free(prefill, decode)


def test_bf16_and_fp32_engines_refuse_each_other_naming_both_dtypes() -> None:
    with engine_trio(32, dtype="float32", decode_dtype="bfloat16") as (prefill, decode, _):
        rid = f"mixed-{time.monotonic_ns()}"
        prefill.add_request(rid, [65] * 20, SamplingParams(max_tokens=1),
                            parse_leg({"role": "prefill", "request_id": rid}))
        decode.add_request(rid, [65] * 20, SamplingParams(max_tokens=4), parse_leg({
            "role": "decode", "request_id": rid, "remote_host": "127.0.0.1",
            "remote_port": prefill.kv_connector.kv_port}))
        failed, deadline = None, time.monotonic() + 30
        while failed is None:
            assert time.monotonic() < deadline, "the decode leg never failed"
            prefill.step()
            failed = next((o for o in decode.step() if o.request_id == rid), None)
        assert failed.finished and failed.finish_reason == "error"
        message = str(failed.error)
        assert "float32" in message and "bfloat16" in message and "dtype: " in message, message
        prefill.abort_request(rid)
        wait_all_free(prefill, decode)
