"""The prefill queue's job contract: round trips, and bytes that are not a job refused with a clear error."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, strategies as st

from common.prefill_job import ACKED, ANSWER, REFUSED, TAKEN, JobError, JobReply, PrefillJob, nats_url

bodies = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=20),
                                                         st.lists(st.integers(0, 2**31), max_size=20)), max_size=6)
jobs = st.builds(PrefillJob, request_id=st.text(min_size=1, max_size=40),
                 path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies,
                 reply=st.text(min_size=1, max_size=40), requester=st.sampled_from(["proxy", "decode"]),
                 deadline=st.floats(0, 4e9))
replies = st.builds(JobReply, kind=st.sampled_from([TAKEN, ANSWER, REFUSED, ACKED]),
                    request_id=st.text(max_size=20),
                    worker=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4),
                    status=st.integers(0, 599), body=st.binary(max_size=64), message=st.text(max_size=40))


@given(jobs)
def test_a_job_round_trips(job: PrefillJob) -> None:
    assert PrefillJob.from_bytes(job.to_bytes()) == job


@given(replies)
def test_a_reply_round_trips(reply: JobReply) -> None:
    assert JobReply.from_bytes(reply.to_bytes()) == reply


@given(st.binary(max_size=200))
def test_garbage_is_a_job_error_never_another_exception(data: bytes) -> None:
    try:
        PrefillJob.from_bytes(data)
    except JobError:
        pass
    try:
        JobReply.from_bytes(data)
    except JobError:
        pass


@pytest.mark.parametrize("obj, words", [
    ({"v": 2}, "job version 2 is not supported"),
    ({"v": 1, "id": "r", "path": "/v1/completions", "body": {}, "reply": "x", "by": "proxy"}, "no 'deadline'"),
    ({"v": 1, "id": "r", "path": "/v1/embeddings", "body": {}, "reply": "x", "by": "proxy", "deadline": 1},
     "path must be"),
    ({"v": 1, "id": "", "path": "/v1/completions", "body": {}, "reply": "x", "by": "proxy", "deadline": 1},
     "request_id"),
    ([1, 2], "not a map"),
])
def test_a_malformed_job_says_what_is_wrong(obj: object, words: str) -> None:
    with pytest.raises(JobError, match=words):
        PrefillJob.from_bytes(msgpack.packb(obj))


def test_nats_urls() -> None:
    assert nats_url("nats://127.0.0.1") == "nats://127.0.0.1:4222"
    assert nats_url("nats://h:4333/") == "nats://h:4333"
    for bad in ("http://h:1", "nats://", "nats://h:x", "h:4222"):
        with pytest.raises(ValueError):
            nats_url(bad)
