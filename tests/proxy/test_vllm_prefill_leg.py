"""A sampled request on `vllm serve` workers: the prefill leg goes unseeded and cannot stop early, and every
token of the answer, the first included, is the decode worker's (sans I/O)."""
from __future__ import annotations

import json

from proxy.requests import COMPLETIONS, CHAT, parse_request, prefill_body, prefill_token_used
from proxy.stitch import StreamStitcher, merge_bodies
from proxy.workers import VLLM_SERVER, WorkerRecord

VLLM_PREFILL = WorkerRecord("prefill", "127.0.0.1", 8100, server=VLLM_SERVER)
OUR_PREFILL = WorkerRecord("prefill", "127.0.0.1", 8100, server="neuron-di")


def test_which_prefill_token_is_the_answers() -> None:
    assert prefill_token_used(OUR_PREFILL, 7) and prefill_token_used(VLLM_PREFILL, None)
    assert not prefill_token_used(VLLM_PREFILL, 7)
    assert prefill_token_used(WorkerRecord("prefill", "h", 1), 7)   # not known to be vLLM


def test_an_unused_prefill_token_is_sampled_unseeded_whatever_stops_it() -> None:
    raw = json.dumps({"model": "m", "prompt": "p", "max_tokens": 9, "temperature": 0.8, "seed": 3,
                      "stop": ["x"], "stop_token_ids": [2], "stream": True}).encode()
    request = parse_request(COMPLETIONS, raw, disaggregated=True)
    body = prefill_body(request, 3, {"role": "prefill", "request_id": "u"}, token_used=False)
    assert "seed" not in body and "stop" not in body and "stop_token_ids" not in body
    assert body["ignore_eos"] is True and body["max_tokens"] == 1 and body["stream"] is False
    assert prefill_body(request, 3, {"role": "prefill", "request_id": "u"})["seed"] == 3


def _chunk(choice: dict) -> str:
    return json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [choice]})


def test_decode_gives_every_token_when_prefills_is_not_used() -> None:
    request = parse_request(CHAT, json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "stream": True}).encode(), disaggregated=True)
    prefill = {"choices": [{"index": 0, "message": {"content": "unseeded"}, "finish_reason": "length"}]}
    stitcher = StreamStitcher(request, "chatcmpl-u", 0, prefill, prefill_token=False)
    assert stitcher.first() == [] and not stitcher.finished
    events = [e for data in (_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}}),
                             _chunk({"index": 0, "delta": {"content": "A"}}),
                             _chunk({"index": 0, "delta": {"content": "B"}, "finish_reason": "length"}))
              for e in stitcher.feed(data)] + stitcher.close()
    payloads = [json.loads(e.decode()[6:]) for e in events if e.startswith(b"data: {")]
    deltas = [p["choices"][0]["delta"] for p in payloads]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "A"}, {"content": "B"}]
    assert stitcher.first_token_matched is None   # nothing to check it against


def test_a_whole_answer_keeps_decodes_first_token_when_prefills_is_not_used() -> None:
    prefill = {"choices": [{"index": 0, "text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [-3.0]}}],
               "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
    decode = {"choices": [{"index": 0, "text": "AB", "logprobs": {"tokens": ["A", "B"], "token_logprobs": [-1.0, -2.0]}}],
              "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    merged = merge_bodies("cmpl-u", prefill, decode, prefill_token=False)
    assert merged["choices"] == decode["choices"] and merged["id"] == "cmpl-u"
    assert merged["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
