"""Several answers per request, logprobs and text at the seam, usage: sans-I/O, driven with plain dicts."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy import CHAT, COMPLETIONS, StreamStitcher, merge_bodies, parse_request, summed_usage
from proxy.fanout import StreamMerger, fan_out, merged_body
from proxy.logprobs import with_first_entry, without_first_entry
from proxy.requests import neuron_prefill_params, prefill_alone, prefill_body


def _request(endpoint=COMPLETIONS, **body) -> object:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if endpoint.is_chat else \
        {"model": "m", "prompt": "hi"}
    return parse_request(endpoint, json.dumps({**base, **body}).encode(), disaggregated=True)


def _events(raw: list[bytes]) -> list:
    return [json.loads(e[6:]) if e != b"data: [DONE]\n\n" else "[DONE]" for e in raw]


def _lp(*tokens: str, offset: int = 0) -> dict:
    """Completions logprobs for `tokens`, each with logprob -len(token) and text offsets from `offset`."""
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"text_offset": offsets, "token_logprobs": [-float(len(t)) for t in tokens], "tokens": list(tokens),
            "top_logprobs": [{t: -float(len(t))} for t in tokens]}


def test_a_list_of_prompts_times_n_is_one_part_per_answer_indexed_and_seeded_as_vllm_does() -> None:
    request = _request(prompt=["a", "b", "c"], n=2, seed=10, temperature=0.5, stream=True)
    parts = fan_out(request)
    assert [(p.index, p.request.body["prompt"], p.request.seed, p.counts_prompt) for p in parts] == [
        (0, "a", 10, True), (1, "a", 11, False), (2, "b", 10, True), (3, "b", 11, False),
        (4, "c", 10, True), (5, "c", 11, False)]
    assert all(p.request.body["n"] == 1 and p.request.body["seed"] == p.request.seed for p in parts)
    assert all((p.request.n, p.request.num_prompts, p.request.stream) == (1, 1, True) for p in parts)


def test_token_id_prompts_chat_choices_and_what_is_not_fanned_out() -> None:
    parts = fan_out(_request(prompt=[[1, 2], [3]], temperature=0))
    assert [p.request.body["prompt"] for p in parts] == [[1, 2], [3]]
    assert all("seed" not in p.request.body for p in parts)  # greedy stays unseeded
    chat = fan_out(_request(CHAT, n=3))
    assert [p.index for p in chat] == [0, 1, 2] and "prompt" not in chat[0].request.body
    drawn = {p.request.seed for p in chat}
    assert len(drawn) == 3 and max(drawn) - min(drawn) == 2  # one drawn seed, + choice
    for one in (_request(prompt=[1, 2, 3]), _request(prompt=["only"]), _request(n=1)):
        assert fan_out(one) is None
    for whole in (_request(prompt=["a", "b"], echo=True), _request(prompt=["a", "b"], max_tokens=1),
                  _request(n=2, prompt_logprobs=1), _request(n=2, use_beam_search=True)):
        assert prefill_alone(whole) and fan_out(whole) is None


def test_merged_body_orders_choices_and_counts_each_prompt_once() -> None:
    parts = fan_out(_request(prompt=["a", "b"], n=2, temperature=0.5))
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "completion_tokens_details": None}
    bodies = [{"id": f"cmpl-{i}", "object": "text_completion", "choices": [{"index": 0, "text": str(i)}],
               "usage": {**usage, "prompt_tokens": 5 + 10 * (i // 2)}} for i in range(4)]
    merged = merged_body("cmpl-X", list(reversed(parts)), list(reversed(bodies)))
    assert merged["id"] == "cmpl-X" and merged["object"] == "text_completion"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "0"), (1, "1"), (2, "2"), (3, "3")]
    assert merged["usage"] == {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32,
                               "completion_tokens_details": None}


def test_stream_merger_renumbers_holds_back_usage_and_ends_once() -> None:
    parts = fan_out(_request(prompt=["a", "b"], stream=True, stream_options={"include_usage": True}))
    merger = StreamMerger("cmpl-X", 7, parts, include_usage=True)
    chunk = {"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "m"}
    out = merger.feed(1, b"data: " + json.dumps({**chunk, "choices": [{"index": 0, "text": "B"}]}).encode()
                      + b"\n\nda")  # the next event cut in two
    out += merger.feed(0, b"data: " + json.dumps({**chunk, "choices": [{"index": 0, "text": "A"}]}).encode()
                       + b"\n\n")
    for part, prompt, lead in ((0, 3, b"data: "), (1, 4, b"ta: ")):
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + 2, "completion_tokens": 2}
        out += merger.feed(part, lead + json.dumps({**chunk, "choices": [], "usage": usage}).encode()
                           + b"\n\ndata: [DONE]\n\n")
    out += merger.close()
    events = _events(out)
    assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:2]] == [(1, "B"), (0, "A")]
    assert {(e["id"], e["created"]) for e in events[:3]} == {("cmpl-X", 7)}
    assert events[2]["usage"] == {"prompt_tokens": 7, "total_tokens": 11, "completion_tokens": 4}
    assert events[2]["choices"] == [] and events[3] == "[DONE]" and len(events) == 4


def test_stream_merger_ends_the_answer_at_a_parts_error() -> None:
    merger = StreamMerger("cmpl-X", 7, fan_out(_request(prompt=["a", "b"], stream=True)), include_usage=False)
    error = {"error": {"message": "decode worker gone", "code": 502}}
    events = _events(merger.feed(1, b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"))
    assert events == [error, "[DONE]"] and merger.failed
    assert merger.feed(0, b'data: {"choices": [{"index": 0, "text": "late"}]}\n\n') == []
    bad = StreamMerger("cmpl-Y", 7, fan_out(_request(prompt=["a", "b"], stream=True)), include_usage=False)
    assert _events(bad.feed(0, b"data: {nope\n\n"))[0]["error"]["code"] == 502 and bad.failed


def test_logprobs_first_entry_comes_from_prefill() -> None:
    prefill, decode = _lp(" x"), _lp(" y", "z", "w")
    merged = with_first_entry(decode, prefill)
    assert merged["tokens"] == [" x", "z", "w"] and merged["token_logprobs"][0] == -2.0
    assert merged["top_logprobs"][0] == {" x": -2.0} and merged["text_offset"] == decode["text_offset"]
    chat = with_first_entry({"content": [{"token": "b"}, {"token": "c"}], "refusal": None},
                            {"content": [{"token": "a"}]})
    assert chat == {"content": [{"token": "a"}, {"token": "c"}], "refusal": None}
    assert with_first_entry(None, prefill) is None and with_first_entry(decode, None) is decode
    assert without_first_entry(_lp("a", "b", offset=3)) == _lp("b", offset=4)
    assert without_first_entry({"content": [{"token": "a"}]}) == {"content": []}


def test_whole_answer_takes_the_first_logprob_from_prefill_and_keeps_decodes_usage_fields() -> None:
    usage = {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": None}
    prefill = {"choices": [{"index": 0, "text": " a", "logprobs": _lp(" a")}], "usage": usage}
    decode = {"id": "cmpl-d", "choices": [{"index": 0, "text": " ab", "logprobs": {**_lp(" a", "b"),
              "token_logprobs": [-9.0, -1.0]}}],
              "usage": {**usage, "total_tokens": 5, "completion_tokens": 2, "completion_tokens_details": None}}
    merged = merge_bodies("cmpl-X", prefill, decode)
    assert merged["choices"][0]["logprobs"]["token_logprobs"] == [-2.0, -1.0]
    assert merged["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                               "prompt_tokens_details": None, "completion_tokens_details": None}
    assert summed_usage(None, usage) is usage


PREFILL = {"model": "m", "system_fingerprint": "fp", "choices": [
    {"index": 0, "text": "x", "logprobs": _lp("x"), "finish_reason": "length", "stop_reason": None,
     "token_ids": [120], "prompt_token_ids": [1, 2], "prompt_logprobs": None}],
    "usage": {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1}}


def _chunk(**choice) -> str:
    return json.dumps({"id": "cmpl-d", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "finish_reason": None, **choice}]})


def test_stitcher_first_chunk_has_a_stream_chunks_fields_and_continuous_usage() -> None:
    request = _request(stream=True, logprobs=1, stream_options={"include_usage": True, "continuous_usage_stats": True})
    first = _events(StreamStitcher(request, "cmpl-X", 5, PREFILL).first())
    assert first == [{"id": "cmpl-X", "object": "text_completion", "created": 5, "model": "m", "choices": [
        {"index": 0, "text": "x", "logprobs": _lp("x"), "finish_reason": None, "stop_reason": None,
         "prompt_token_ids": [1, 2], "token_ids": [120]}],
        "usage": {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1}}]


def test_stitcher_passes_on_only_the_text_the_client_lacks() -> None:
    """Decode holds text back (a stop string may be forming) and sends two tokens in one chunk: the client gets
    prefill's "x", then the rest of decode's text once, and every token's logprobs once."""
    stitcher = StreamStitcher(_request(stream=True, logprobs=1), "cmpl-X", 5, PREFILL)
    out = stitcher.first()
    out += stitcher.feed(_chunk(text="", logprobs=_lp("x"), token_ids=[120], prompt_token_ids=[1, 2]))
    assert stitcher.first_token_matched is None  # decode's text has not reached prefill's yet
    out += stitcher.feed(_chunk(text="xyz", logprobs=_lp("y", "z", offset=1), token_ids=[121, 122]))
    out += stitcher.feed(_chunk(text="w", logprobs=_lp("w", offset=3), token_ids=[119], finish_reason="length"))
    events = _events(out + stitcher.close())
    assert stitcher.first_token_matched is True
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "yz", "w"]
    assert [t for e in events[:-1] for t in e["choices"][0]["logprobs"]["tokens"]] == ["x", "y", "z", "w"]
    assert [o for e in events[:-1] for o in e["choices"][0]["logprobs"]["text_offset"]] == [0, 1, 2, 3]
    assert [e["choices"][0]["token_ids"] for e in events[:-1]] == [[120], [121, 122], [119]]


@given(st.text(min_size=1, max_size=12), st.lists(st.text(max_size=5), min_size=1, max_size=8),
       st.integers(min_value=0, max_value=3))
def test_stitched_text_is_decodes_text_however_decode_chunks_it(first: str, chunks: list[str], held: int) -> None:
    """Decode's text (prefill's token first) cut anyhow, its first `held` chunks held back as empty."""
    chunks = [""] * held + [first + chunks[0]] + chunks[1:]
    prefill = {**PREFILL, "choices": [{**PREFILL["choices"][0], "text": first}]}
    stitcher = StreamStitcher(_request(stream=True), "cmpl-X", 5, prefill)
    out = stitcher.first()
    for i, text in enumerate(chunks):
        out += stitcher.feed(_chunk(text=text, finish_reason="length" if i == len(chunks) - 1 else None))
    events = _events(out + stitcher.close())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "".join(chunks)
    assert stitcher.first_token_matched is True


def test_with_stop_strings_prefills_text_waits_for_decodes() -> None:
    """A server holds back text that may start a stop string, and never shows the stop string."""
    stitcher = StreamStitcher(_request(stream=True, logprobs=1, stop=["xy"]), "cmpl-X", 5, PREFILL)
    out = stitcher.first()
    out += stitcher.feed(_chunk(text="", logprobs=_lp("x")))
    out += stitcher.feed(_chunk(text="", logprobs=_lp("y", offset=1), finish_reason="stop", stop_reason="xy"))
    events = _events(out + stitcher.close())
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["", ""]
    assert [e["choices"][0]["logprobs"]["tokens"] for e in events[:-1]] == [["x"], ["y"]]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_stitcher_drops_decodes_first_token_from_a_chunk_of_several() -> None:
    stitcher = StreamStitcher(_request(stream=True, logprobs=1), "cmpl-X", 5, PREFILL)
    stitcher.first()
    events = _events(stitcher.feed(_chunk(text="xy", logprobs=_lp("x", "y"), token_ids=[120, 121],
                                          prompt_token_ids=[1, 2])))
    assert events[0]["choices"][0] == {"index": 0, "finish_reason": None, "text": "y",
                                       "logprobs": _lp("y", offset=1), "token_ids": [121], "prompt_token_ids": None}


def test_stitcher_ended_by_prefills_token_carries_its_fingerprint_and_usage_without_nulls() -> None:
    ended = {**PREFILL, "choices": [{**PREFILL["choices"][0], "finish_reason": "stop", "stop_reason": 2}],
             "usage": {**PREFILL["usage"], "completion_tokens_details": None}}
    plain = _events(StreamStitcher(_request(stream=True), "cmpl-X", 5, ended).first())
    assert plain[0]["system_fingerprint"] == "fp" and plain[0]["choices"][0]["stop_reason"] == 2
    assert plain[1] == "[DONE]"
    usage = _events(StreamStitcher(_request(stream=True, stream_options={"include_usage": True}), "cmpl-X", 5,
                                   ended).first())
    assert "system_fingerprint" not in usage[0]
    assert usage[1]["usage"] == PREFILL["usage"] and usage[1]["system_fingerprint"] == "fp"


def test_chat_stitcher_role_chunk_carries_the_prompt_fields() -> None:
    prefill = {"model": "m", "prompt_token_ids": None, "prompt_text": None, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "{"}, "finish_reason": "length", "token_ids": None}]}
    events = _events(StreamStitcher(_request(CHAT, stream=True), "chatcmpl-X", 5, prefill).first())
    assert events[0]["prompt_token_ids"] is None and "prompt_text" in events[0]
    assert events[1]["choices"][0] == {"index": 0, "delta": {"content": "{"}, "logprobs": None,
                                       "finish_reason": None, "token_ids": None}


@pytest.mark.parametrize("min_tokens,sent", [(None, None), (1, 1), (5, 1), (0, 0)])
def test_prefill_leg_min_tokens_fits_its_one_token(min_tokens: int | None, sent: int | None) -> None:
    body = prefill_body(_request(max_tokens=8, min_tokens=min_tokens), None, neuron_prefill_params("u"))
    assert body.get("min_tokens") == sent and body["max_tokens"] == 1
