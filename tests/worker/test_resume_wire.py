"""The resume keys on our worker's wire: parsed, refused when malformed, and the hand-back error's type."""
from __future__ import annotations

import pytest

from common.stream_resume import HANDED_BACK, RESUME_FROM, RESUME_TEXT, TOKEN_IDS, Resumed
from worker.errors import InvalidRequestError, StreamHandedBack
from worker.server.protocol import error_for, parse_request
from worker.server.responses import ChoiceBody, ResponseShape


def test_resume_keys_are_parsed() -> None:
    req = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], RESUME_FROM: [3, 4],
                                 RESUME_TEXT: 2, TOKEN_IDS: True}, "m")
    assert (req.resume_from, req.token_ids) == (Resumed((3, 4), 2), True)
    plain = parse_request("completion", {"prompt": "x"}, "m")
    assert (plain.resume_from, plain.token_ids) == (Resumed(), False)


@pytest.mark.parametrize("body", [{RESUME_FROM: "12"}, {RESUME_FROM: [1, True]}, {TOKEN_IDS: 1},
                                  {RESUME_FROM: [1], "n": 2, "temperature": 1.0}, {RESUME_FROM: [1], "echo": True},
                                  {RESUME_FROM: [1], RESUME_TEXT: -1}, {RESUME_FROM: [1], RESUME_TEXT: "3"}])
def test_malformed_resume_keys_are_a_400_naming_them(body: dict) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_request("completion", {"prompt": "x", **body}, "m")
    assert getattr(caught.value, "param") in (RESUME_FROM, RESUME_TEXT, TOKEN_IDS)


def test_a_handed_back_stream_is_a_503_of_its_own_type() -> None:
    status, body, _ = error_for(StreamHandedBack("draining"))
    assert (status, body["error"]["type"]) == (503, HANDED_BACK)


def test_chunks_carry_token_ids_when_asked() -> None:
    shape = ResponseShape("completion", "r", "m")
    assert shape.chunk(ChoiceBody(0, "a", token_ids=[5]))["choices"][0]["token_ids"] == [5]
    assert shape.chunk(ChoiceBody(0, "a"))["choices"][0]["token_ids"] is None
