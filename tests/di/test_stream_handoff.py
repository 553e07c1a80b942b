"""A running stream handed from one decode engine to another with its KV (worker/engine/stream_handoff.py).

Two in-process decode engines over shm: the first runs whole requests for a few steps, then hands each
off (its KV held for a pull); the second resumes each from the tokens so far, pulling that KV instead of
recomputing it. Together they must produce exactly one `both` engine's tokens, greedy and seeded, and
every block must come back.
"""
from __future__ import annotations

import time
from typing import Iterator

import pytest
import torch

from common.handoff import DecodeParams
from common.stream_resume import Resumed
from tests.di.engine_pair import wait_all_free
from worker import EngineConfig, LLMEngine, SamplingParams
from worker.engine.kv_connector import KVConnector, KVConnectorConfig

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65, 69, 73], [2, 4, 6, 8, 10]]
PARAMS = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)]


def _decode(hand_back_port: int | None = None, hand_back_timeout: float = 3.0) -> LLMEngine:
    config = KVConnectorConfig("decode", "shm", engine_id=f"decode-{time.monotonic_ns()}",
                               hand_back_port=hand_back_port, hand_back_timeout=hand_back_timeout)
    return LLMEngine(EngineConfig(role="decode", num_kv_blocks=64), kv_connector=KVConnector(config))


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    torch.set_num_threads(1)
    first, second, both = _decode(hand_back_port=0, hand_back_timeout=1.0), _decode(), LLMEngine(
        EngineConfig(num_kv_blocks=64))
    try:
        yield first, second, both
    finally:
        first.close()
        second.close()


def _run_until(engine: LLMEngine, outputs: dict[str, list[int]], done: int) -> None:
    """Steps `engine` until every request of `outputs` has `done` tokens."""
    while min(len(tokens) for tokens in outputs.values()) < done:
        for out in engine.step():
            assert out.error is None, out.error
            outputs[out.request_id].extend(out.new_token_ids)


def test_a_handed_off_stream_goes_on_exactly_from_its_pulled_kv(engines) -> None:
    first, second, both = engines
    want = both.generate(PROMPTS, PARAMS)
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(len(PROMPTS))}
    for (rid, prompt), params in zip(zip(got, PROMPTS), PARAMS):
        first.add_request(rid, prompt, params)
    _run_until(first, got, 17)   # 17 and more: past a block boundary of the outputs too
    pulled: list[int] = []
    second.kv_connector.on_pull = lambda num_pulled, num_skipped, block_bytes: pulled.append(num_pulled)
    for (rid, prompt), params in zip(zip(got, PROMPTS), PARAMS):
        source = first.role.hand_offs.hand_off(rid)
        assert source is not None and source.request_id == rid
        second.add_request(rid, prompt, params, DecodeParams(source.host, source.port, rid, source.engine_id),
                           resumed=Resumed(tuple(got[rid])))
    assert first.stats().num_running == 0 and first.stats().num_transferring == len(PROMPTS)
    unfinished, deadline = set(got), time.monotonic() + 60
    while unfinished:
        assert time.monotonic() < deadline, unfinished
        assert not first.step()   # a handed-off stream makes no output here
        for out in second.step():
            assert out.error is None, out.error
            got[out.request_id].extend(out.new_token_ids)
            if out.finished:
                unfinished.discard(out.request_id)
    assert list(got.values()) == want
    # The KV moved, not recomputed: every block of prompt and outputs but the newest was pulled.
    assert sorted(pulled) == sorted((len(p) + 17 - 1 + 15) // 16 for p in PROMPTS)
    wait_all_free(first, second)


def test_a_handed_off_stream_nobody_pulls_is_freed_after_the_timeout(engines) -> None:
    first, second, _ = engines
    outputs: dict[str, list[int]] = {"lonely": []}
    first.add_request("lonely", PROMPTS[1], PARAMS[0])
    _run_until(first, outputs, 3)
    assert first.role.hand_offs.hand_off("lonely") is not None
    assert first.stats().num_blocks_used > 0
    wait_all_free(first)   # the 1 s hand-back timeout of the first engine


def test_a_stream_that_cannot_be_handed_off_with_its_kv_is_left_running() -> None:
    engine = _decode()   # no hand-back port: the drain ends such a stream for the next worker to recompute
    try:
        outputs: dict[str, list[int]] = {"r": []}
        engine.add_request("r", PROMPTS[1], PARAMS[0])
        _run_until(engine, outputs, 2)
        assert engine.role.hand_offs.hand_off("r") is None and engine.role.hand_offs.hand_off("unknown") is None
        assert engine.stats().num_running == 1
        engine.abort_request("r")
        wait_all_free(engine)
    finally:
        engine.close()
