"""Two engines in one process, prefill and decode over a real shm transport: exact token ids."""
from __future__ import annotations

import time
from typing import Iterator

import pytest
import torch

from tests.helpers import free_port
from worker import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from worker.engine.kv_connector import KVConnector, KVConnectorConfig

NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    torch.set_num_threads(1)
    prefill = LLMEngine(EngineConfig(role="prefill", num_kv_blocks=NUM_BLOCKS),
                        kv_connector=KVConnector(KVConnectorConfig("prefill", "shm", kv_port=free_port())))
    decode = LLMEngine(EngineConfig(role="decode", num_kv_blocks=NUM_BLOCKS),
                       kv_connector=KVConnector(KVConnectorConfig("decode", "shm", engine_id="decode-test")))
    both = LLMEngine(EngineConfig(num_kv_blocks=NUM_BLOCKS))
    try:
        yield prefill, decode, both
    finally:
        prefill.close()
        decode.close()


def run_pair(prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]],
             params: list[SamplingParams], tag: str = "") -> tuple[list[int], list[list[int]]]:
    """Both legs of every request, stepped until decode finished them all; (first tokens, outputs)."""
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {f"{tag or time.monotonic_ns()}-{i}": [] for i in range(len(prompts))}
    for (rid, prompt), p in zip(zip(tokens, prompts), params):
        leg = SamplingParams(max_tokens=1, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                             ignore_eos=p.ignore_eos)
        prefill.add_request(rid, prompt, leg, {"role": "prefill", "request_id": rid})
        decode.add_request(rid, prompt, p, {"role": "decode", "request_id": rid, "remote_host": "127.0.0.1",
                                            "remote_port": prefill.kv_connector.kv_port})
    unfinished, deadline = set(tokens), time.monotonic() + 120
    while unfinished:
        assert time.monotonic() < deadline, f"still unfinished: {sorted(unfinished)}"
        for out in prefill.step():
            assert out.error is None
            first[out.request_id] = out.new_token_ids[0]
        for out in decode.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                unfinished.discard(out.request_id)
    return [first[rid] for rid in tokens], list(tokens.values())


def wait_all_free(*engines: LLMEngine) -> None:
    deadline = time.monotonic() + 30
    while any(e.stats().num_blocks_used for e in engines):
        assert time.monotonic() < deadline, [e.stats() for e in engines]
        for engine in engines:
            engine.step()  # takes the connector's releases
        time.sleep(0.01)


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 0.9, "seed": 11},
    {"temperature": 1.0, "top_k": 30, "seed": 12},
    {"temperature": 0.8, "top_p": 0.85, "seed": 13},
])
def test_pair_token_ids_equal_both(engines, sampling: dict) -> None:
    prefill, decode, both = engines
    prompts = [[(7 * i + j) % 200 + 30 for j in range(n)] for i, n in enumerate([1, 15, 16, 17, 100, 333, 700])]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, **{**sampling, "seed": sampling.get("seed", 0) + i})
              for i in range(len(prompts))]
    want = both.generate(prompts, params)
    first, got = run_pair(prefill, decode, prompts, params)
    assert got == want
    assert first == [w[0] for w in want]
    wait_all_free(prefill, decode)


def test_prefill_abort_fails_the_decode_leg_at_once(engines) -> None:
    prefill, decode, _ = engines
    rid = f"aborted-{time.monotonic_ns()}"
    prefill.add_request(rid, [65] * 40, SamplingParams(max_tokens=1), {"role": "prefill"})
    prefill.abort_request(rid)
    decode.add_request(rid, [65] * 40, SamplingParams(max_tokens=4), {
        "role": "decode", "remote_host": "127.0.0.1", "remote_port": prefill.kv_connector.kv_port})
    start, failed = time.monotonic(), None
    while failed is None:
        assert time.monotonic() - start < 10, "the decode leg waited for its deadline"
        prefill.step()
        failed = next((o for o in decode.step() if o.request_id == rid), None)
    assert failed.finished and failed.finish_reason == "error"
    assert f"request {rid!r} was aborted on the prefill side" in str(failed.error)
    wait_all_free(prefill, decode)


def test_an_id_still_published_is_refused(engines) -> None:
    prefill, decode, _ = engines
    tag = f"reused-{time.monotonic_ns()}"
    run_pair(prefill, decode, [[70] * 20], [SamplingParams(max_tokens=2)], tag)
    rid = f"{tag}-0"  # pulled a moment ago: remembered for the abort timeout, so a late lookup gets its answer
    with pytest.raises(InvalidRequestError, match="already in use"):
        prefill.add_request(rid, [70] * 20, SamplingParams(max_tokens=1), {"role": "prefill"})
    wait_all_free(prefill, decode)


@pytest.mark.parametrize("stage", ["waiting", "pulling"])
def test_decode_abort_has_prefill_free_the_blocks_when_it_publishes(engines, stage: str) -> None:
    """The decode leg is gone before prefill finished: prefill frees at its publish, not after
    its abort timeout (60 s)."""
    prefill, decode, _ = engines
    rid, prompt = f"dropped-{stage}-{time.monotonic_ns()}", [66] * 40
    decode.add_request(rid, prompt, SamplingParams(max_tokens=4), {
        "role": "decode", "remote_host": "127.0.0.1", "remote_port": prefill.kv_connector.kv_port})
    if stage == "pulling":
        decode.step()                                   # admitted: its pull is asking prefill
        assert decode.stats().num_transferring == 1
    decode.abort_request(rid)
    deadline = time.monotonic() + 10
    while decode.has_unfinished_requests():             # a cancelled pull may end a moment later
        assert time.monotonic() < deadline
        decode.step()
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1), {"role": "prefill"})
    assert [o.finished for o in prefill.step() if o.request_id == rid] == [True]
    published = time.monotonic()
    while prefill.stats().num_blocks_used:
        assert time.monotonic() - published < 1.0, "prefill held the blocks of a request decode dropped"
        prefill.step()
        time.sleep(0.005)
