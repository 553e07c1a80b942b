"""Penalties, logit_bias, min_tokens, stop_token_ids, logprobs and JSON-schema constraints across the seam: a prefill engine
and a decode engine (one process, shm) pick exactly what one `both` engine picks, and report its
logprobs; prompt logprobs come from a prefill engine alone."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Iterator

import llguidance
import pytest

from common.handoff import parse_leg
from tests.di.engine_pair import engine_trio, wait_all_free
from worker import InvalidRequestError, LLMEngine, RequestOutput, SamplingParams

PROMPTS = [[256] + [(5 * i + j) % 90 + 32 for j in range(n)] for i, n in enumerate([3, 16, 40, 130])]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
COMPACT = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
CASES = {
    "greedy-penalties": SamplingParams(max_tokens=12, temperature=0, presence_penalty=0.8, frequency_penalty=0.5,
                                       repetition_penalty=1.4, logprobs=3),
    "seeded-everything": SamplingParams(max_tokens=12, temperature=0.9, seed=11, top_k=40, min_p=0.02,
                                        presence_penalty=0.5, repetition_penalty=1.2, logit_bias={65: 3.0, 32: -2.0},
                                        min_tokens=6, logprobs=2),
    "greedy-bias-min-tokens": SamplingParams(max_tokens=10, temperature=0, logit_bias={101: 4.0, 257: 8.0},
                                             min_tokens=10, stop_token_ids=[101], logprobs=0),
    "seeded-json-schema": SamplingParams(max_tokens=40, temperature=0.8, seed=5, grammar=COMPACT, logprobs=1),
}


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    with engine_trio(128) as trio:
        yield trio


def run_one(engine: LLMEngine, params: list[SamplingParams], legs: list[dict | None]) -> list[list[RequestOutput]]:
    tag = time.monotonic_ns()
    outputs: dict[str, list[RequestOutput]] = {f"{tag}-{i}": [] for i in range(len(PROMPTS))}
    for (rid, prompt), p, leg in zip(zip(outputs, PROMPTS), params, legs):
        engine.add_request(rid, prompt, p, None if leg is None else parse_leg({**leg, "request_id": rid}))
    while not all(o and o[-1].finished for o in outputs.values()):
        for out in engine.step():
            outputs[out.request_id].append(out)
    return list(outputs.values())


def pair(prefill: LLMEngine, decode: LLMEngine, params: SamplingParams) -> tuple[list, list]:
    """(prefill outputs, decode outputs) per prompt; both legs stepped together, as two workers run."""
    tag = time.monotonic_ns()
    rids = [f"pair-{tag}-{i}" for i in range(len(PROMPTS))]
    leg = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))   # as the proxy sends it
    for rid, prompt in zip(rids, PROMPTS):
        prefill.add_request(rid, prompt, leg, parse_leg({"role": "prefill", "request_id": rid}))
        decode.add_request(rid, prompt, params, parse_leg({"role": "decode", "request_id": rid, "remote_host": "127.0.0.1",
                                                           "remote_port": prefill.kv_connector.kv_port}))
    got: dict[str, tuple[list, list]] = {rid: ([], []) for rid in rids}
    deadline = time.monotonic() + 60
    while not all(d and d[-1].finished for _, d in got.values()):
        assert time.monotonic() < deadline
        for out in prefill.step():
            got[out.request_id][0].append(out)
        for out in decode.step():
            assert out.error is None, out.error
            got[out.request_id][1].append(out)
    return [p for p, _ in got.values()], [d for _, d in got.values()]


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def entries(outputs: list[RequestOutput]) -> list:
    return [e for o in outputs for e in (o.logprobs or [])]


@pytest.mark.parametrize("case", CASES)
def test_decode_leg_picks_and_scores_what_one_worker_does(engines, case: str) -> None:
    prefill, decode, both = engines
    params = CASES[case]
    want = run_one(both, [params] * len(PROMPTS), [None] * len(PROMPTS))
    prefill_outs, decode_outs = pair(prefill, decode, params)
    for w, p, d in zip(want, prefill_outs, decode_outs):
        assert tokens(d) == tokens(w) and tokens(p) == tokens(w)[:1]
        assert (d[-1].finish_reason, d[-1].stop_reason) == (w[-1].finish_reason, w[-1].stop_reason)
        assert "".join(o.text_delta for o in d) == "".join(o.text_delta for o in w)
        mine, theirs = entries(d), entries(w)
        assert mine[0] is None   # the prefill worker sampled it: its answer carries the entry
        for a, b in zip([entries(p)[0]] + mine[1:], theirs):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert [a.logprob, *(v for _, v in a.top)] == pytest.approx([b.logprob, *(v for _, v in b.top)], abs=1e-4)
        if params.min_tokens:
            banned = set(params.stop_token_ids) | set(both.tokenizer.eos_token_ids)
            assert not banned & set(tokens(w)[:params.min_tokens])
    wait_all_free(prefill, decode)


def test_json_schema_outputs_are_json_matching_it(engines) -> None:
    _, _, both = engines
    outs = run_one(both, [CASES["seeded-json-schema"]] * len(PROMPTS), [None] * len(PROMPTS))
    for out in outs:
        assert out[-1].finish_reason == "stop"   # EOS, once the object is whole
        value = json.loads("".join(o.text_delta for o in out))
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)


def test_greedy_bias_case_ends_on_its_stop_token_after_min_tokens(engines) -> None:
    """The bias makes token 101 likely; min_tokens keeps it out until 10 tokens are out, then max_tokens ends it."""
    _, _, both = engines
    params = dataclasses.replace(CASES["greedy-bias-min-tokens"], max_tokens=14)
    outs = run_one(both, [params] * len(PROMPTS), [None] * len(PROMPTS))
    assert any(o[-1].stop_reason == 101 and len(tokens(o)) > 10 for o in outs)
    assert all(101 not in tokens(o)[:10] for o in outs)


def test_prompt_logprobs_come_from_a_prefill_engine_and_not_from_a_decode_leg(engines) -> None:
    prefill, decode, both = engines
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2, logprobs=1)
    want = run_one(both, [params] * len(PROMPTS), [None] * len(PROMPTS))
    got = run_one(prefill, [params] * len(PROMPTS), [None] * len(PROMPTS))   # served whole, no decode leg
    for w, g, prompt in zip(want, got, PROMPTS):
        assert len(g[0].prompt_logprobs) == len(prompt) and g[0].prompt_logprobs[0] is None
        for a, b, token in zip(g[0].prompt_logprobs[1:], w[0].prompt_logprobs[1:], prompt[1:]):
            assert a.token_id == b.token_id == token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs cannot be computed by a decode leg"):
        decode.add_request("nope", PROMPTS[0], params, parse_leg({"role": "decode", "remote_host": "127.0.0.1",
                                                                  "remote_port": prefill.kv_connector.kv_port}))
    wait_all_free(prefill, decode)


def test_min_tokens_yields_to_a_grammar_that_allows_only_its_end(engines) -> None:
    """A choice of one word is whole after a few tokens; min_tokens would then ban the only token left (EOS)."""
    _, _, both = engines
    grammar = llguidance.LLMatcher.grammar_from_regex("yes|no")
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=2, grammar=grammar, min_tokens=6)
    for out in run_one(both, [params] * len(PROMPTS), [None] * len(PROMPTS)):
        assert "".join(o.text_delta for o in out) in ("yes", "no") and out[-1].finish_reason == "stop"
        assert len(out) < params.min_tokens   # ended by EOS after the word, min_tokens notwithstanding
