"""Two engines in one process, prefill and decode over a real shm transport: exact token ids."""
from __future__ import annotations

import time
from typing import Iterator

import pytest

from common.handoff import parse_leg
from tests.di.engine_pair import engine_trio, run_pair, wait_all_free
from worker import InvalidRequestError, LLMEngine, SamplingParams

NUM_BLOCKS = 256


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    with engine_trio(NUM_BLOCKS) as trio:
        yield trio


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
    prefill.add_request(rid, [65] * 40, SamplingParams(max_tokens=1), parse_leg({"role": "prefill"}))
    prefill.abort_request(rid)
    decode.add_request(rid, [65] * 40, SamplingParams(max_tokens=4), parse_leg({
        "role": "decode", "remote_host": "127.0.0.1", "remote_port": prefill.kv_connector.kv_port}))
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
        prefill.add_request(rid, [70] * 20, SamplingParams(max_tokens=1), parse_leg({"role": "prefill"}))
    wait_all_free(prefill, decode)


@pytest.mark.parametrize("stage", ["waiting", "pulling"])
def test_decode_abort_has_prefill_free_the_blocks_when_it_publishes(engines, stage: str) -> None:
    """The decode leg is gone before prefill finished: prefill frees at its publish, not after
    its abort timeout (60 s)."""
    prefill, decode, _ = engines
    rid, prompt = f"dropped-{stage}-{time.monotonic_ns()}", [66] * 40
    decode.add_request(rid, prompt, SamplingParams(max_tokens=4), parse_leg({
        "role": "decode", "remote_host": "127.0.0.1", "remote_port": prefill.kv_connector.kv_port}))
    if stage == "pulling":
        decode.step()                                   # admitted: its pull is asking prefill
        assert decode.stats().num_transferring == 1
    decode.abort_request(rid)
    deadline = time.monotonic() + 10
    while decode.has_unfinished_requests():             # a cancelled pull may end a moment later
        assert time.monotonic() < deadline
        decode.step()
    prefill.add_request(rid, prompt, SamplingParams(max_tokens=1), parse_leg({"role": "prefill"}))
    assert [o.finished for o in prefill.step() if o.request_id == rid] == [True]
    published = time.monotonic()
    while prefill.stats().num_blocks_used:
        assert time.monotonic() - published < 1.0, "prefill held the blocks of a request decode dropped"
        prefill.step()
        time.sleep(0.005)
