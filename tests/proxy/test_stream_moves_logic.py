"""The stream mover, sans I/O: the tokens it notes, what the client sees of them, and the resumed leg's body."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from prometheus_client import CollectorRegistry

from common.stream_resume import HANDED_BACK, RESUME_FROM, RESUME_TEXT, TOKEN_IDS
from proxy import CHAT, COMPLETIONS, StreamStitcher, UpstreamUnavailable, WorkerRecord, parse_request
from proxy.errors import UpstreamStatus
from proxy.flows import DecodeLeg
from proxy.stream_moves import MoveMetrics, StreamMover

DECODE = WorkerRecord("decode", "127.0.0.1", 8200)
OTHER = WorkerRecord("decode", "127.0.0.1", 8201)


def _mover(body: dict[str, Any], endpoint=COMPLETIONS) -> tuple[StreamMover, list[tuple[WorkerRecord, dict, dict]]]:
    request = parse_request(endpoint, json.dumps({"model": "m", "stream": True, **body}).encode(), True)
    opened: list[tuple[WorkerRecord, dict, dict]] = []

    def open_leg(worker: WorkerRecord, leg_body: dict, headers: dict) -> DecodeLeg:
        opened.append((worker, leg_body, headers))
        return DecodeLeg(worker, asyncio.get_event_loop().create_future(), asyncio.Queue())

    mover = StreamMover(request, "uid", 42, open_leg, lambda protocol: OTHER, lambda worker, why: None,
                        MoveMetrics(CollectorRegistry()))
    return mover, opened


def _chunk(ids: list[int] | None, text: str = "x", chat: bool = False) -> str:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return json.dumps({"id": "d", "choices": [{**choice, "token_ids": ids}]})


def test_token_ids_are_noted_and_hidden_and_the_resumed_body_carries_them() -> None:
    async def run() -> None:
        mover, opened = _mover({"prompt": "hi", "max_tokens": 9, "echo": True})
        first = mover.prefill_answer({"choices": [{"index": 0, "text": "a", "token_ids": [7]}]})
        assert first["choices"][0]["token_ids"] is None
        seen = [json.loads(mover.observe(_chunk(ids)) or "{}") for ids in ([7], [8], [9])]
        assert [c["choices"][0]["token_ids"] for c in seen] == [None, None, None]
        request = parse_request(COMPLETIONS, b'{"model": "m", "prompt": "hi", "stream": true}', True)
        stitcher = StreamStitcher(request, "cmpl-uid", 0, first)
        leg = DecodeLeg(DECODE, asyncio.get_event_loop().create_future(), asyncio.Queue())
        mover.move(leg, "worker_lost", stitcher, None)
        worker, body, headers = opened[0]
        assert worker == OTHER and headers == {"X-Request-Id": "uid-moved1"}
        assert (body[RESUME_FROM], body[TOKEN_IDS], body["seed"], "echo" in body) == ([7, 8, 9], True, 42, False)
        assert leg.task.cancelled() and stitcher.moves == 1
        mover.observe(_chunk([10]))   # the moved leg repeats nothing
        mover.move(DecodeLeg(OTHER, asyncio.get_event_loop().create_future()), "handed_back", stitcher, None)
        assert opened[1][1][RESUME_FROM] == [7, 8, 9, 10]
    asyncio.run(run())


def _texts(events: list[bytes]) -> str:
    return "".join(json.loads(e.decode()[len("data: "):])["choices"][0]["text"] for e in events)


def test_a_move_before_decode_repeated_prefills_token_loses_no_text() -> None:
    """Decode lost before its first chunk (the repeat of prefill's token): the next leg's first token is the
    answer's second, and the client sees its text (it once vanished: the stitcher still awaited the repeat)."""
    async def run() -> None:
        for decode_chunks, client_has in (([], 1), ([([7], "_"), ([8], "I")], 2)):
            mover, opened = _mover({"prompt": "hi", "max_tokens": 9})
            first = mover.prefill_answer({"choices": [{"index": 0, "text": "_", "token_ids": [7]}]})
            request = parse_request(COMPLETIONS, b'{"model": "m", "prompt": "hi", "stream": true}', True)
            stitcher = StreamStitcher(request, "cmpl-uid", 0, first)
            shown = _texts(stitcher.first())
            for ids, text in decode_chunks:
                shown += _texts(stitcher.feed(mover.observe(_chunk(ids, text)) or ""))
            mover.move(DecodeLeg(DECODE, asyncio.get_event_loop().create_future()), "worker_lost", stitcher, None)
            assert opened[0][1][RESUME_TEXT] == client_has == len(shown)
            for ids, text in (([9], "N" if decode_chunks else "I"), ([10], "D")):
                shown += _texts(stitcher.feed(mover.observe(_chunk(ids, text)) or ""))
            assert shown == ("_IND" if decode_chunks else "_ID")
    asyncio.run(run())


def test_a_client_that_asked_for_token_ids_keeps_them() -> None:
    mover, _ = _mover({"prompt": "hi", TOKEN_IDS: True})
    assert json.loads(mover.observe(_chunk([3])) or "{}")["choices"][0]["token_ids"] == [3]


def test_a_moved_chat_stream_drops_its_own_role_chunk() -> None:
    async def run() -> None:
        mover, _ = _mover({"messages": [{"role": "user", "content": "hi"}]}, CHAT)
        role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        assert mover.observe(role) == role   # the first leg's: the stitcher decides
        request = parse_request(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', True)
        stitcher = StreamStitcher(request, "chatcmpl-uid", 0, {"choices": [{"index": 0, "message": {"content": "a"}}]})
        mover.move(DecodeLeg(DECODE, asyncio.get_event_loop().create_future()), "worker_lost", stitcher, None)
        assert mover.observe(role) is None
        assert mover.observe(_chunk([5], chat=True)) is not None
    asyncio.run(run())


def test_what_counts_as_a_lost_leg() -> None:
    mover, _ = _mover({"prompt": "hi"})
    assert mover.why_lost(UpstreamUnavailable("cut", "decode")) == "worker_lost"
    assert mover.why_lost(json.dumps({"error": {"type": HANDED_BACK, "code": 503}})) == "handed_back"
    assert mover.why_lost(json.dumps({"error": {"type": "server_error", "code": 500}})) is None
    assert mover.why_lost(_chunk([1], text=HANDED_BACK)) is None


def test_a_handed_back_stream_whose_kv_waits_is_pulled_and_recomputed_when_the_pull_fails() -> None:
    """A hand-back naming where its KV waits: the next leg is a decode leg pulling it, under the id it is held by;
    that leg failing before it sent anything moves the answer once more, recomputed."""
    async def run() -> None:
        mover, opened = _mover({"prompt": "hi", "max_tokens": 9})
        first = mover.prefill_answer({"choices": [{"index": 0, "text": "a", "token_ids": [7]}]})
        request = parse_request(COMPLETIONS, b'{"model": "m", "prompt": "hi", "stream": true}', True)
        stitcher = StreamStitcher(request, "cmpl-uid", 0, first)
        mover.observe(_chunk([7]))
        mover.observe(_chunk([8]))
        held = {"remote_host": "127.0.0.1", "remote_port": 9999, "remote_engine_id": "d1", "request_id": "uid"}
        marker = json.dumps({"error": {"type": HANDED_BACK, "message": "draining", "kv_transfer_params": held}})
        assert mover.why_lost(marker) == "handed_back"
        mover.move(DecodeLeg(DECODE, asyncio.get_event_loop().create_future()), "handed_back", stitcher, None)
        worker, body, headers = opened[0]
        assert headers == {"X-Request-Id": "uid"} and body[RESUME_FROM] == [7, 8]
        assert body["kv_transfer_params"] == {"role": "decode", **held}
        failed = UpstreamStatus(503, b'{"error": {"type": "kv_transfer_error"}}', "decode", OTHER.address)
        assert mover.why_lost(failed) == "kv_pull_failed"
        mover.move(DecodeLeg(OTHER, asyncio.get_event_loop().create_future()), "kv_pull_failed", stitcher, failed)
        _, body, headers = opened[1]
        assert headers == {"X-Request-Id": "uid-moved2"} and "kv_transfer_params" not in body
        assert body[RESUME_FROM] == [7, 8]
        assert mover.why_lost(failed) is None   # a recomputing leg's error is the answer's
        # A hand-back naming no complete place is recomputed.
        assert mover.why_lost(json.dumps({"error": {"type": HANDED_BACK, "kv_transfer_params": {"x": 1}}})) \
            == "handed_back"
        mover.move(DecodeLeg(OTHER, asyncio.get_event_loop().create_future()), "handed_back", stitcher, None)
        assert "kv_transfer_params" not in opened[2][1]
    asyncio.run(run())
