"""Every failure of one leg ends the request with a clear error and frees every block on both sides."""
from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import pytest

from tests.di.workers import decode_body, prefill_body, worker_pair
from tests.worker_process import WorkerProcess
from stack.serving import free_port
from tests.helpers import wait_until

ABORT_TIMEOUT_S = 3
PULL_TIMEOUT_S = 3
BODY = {"model": "neuron-di-builtin", "prompt": list(range(40, 140)), "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def short_pair() -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    with worker_pair("shm", ["--kv-abort-timeout", str(ABORT_TIMEOUT_S)],
                     ["--kv-pull-timeout", str(PULL_TIMEOUT_S)]) as workers:
        yield workers


@pytest.fixture(autouse=True)
def blocks_free_after(short_pair: tuple[WorkerProcess, WorkerProcess]) -> Iterator[None]:
    yield
    for worker in short_pair:
        worker.wait_blocks_free(timeout=ABORT_TIMEOUT_S + 10)


def post(url: str, body: dict, uid: str, **kw) -> httpx.Response:
    return httpx.post(url, json=body, headers={"X-Request-Id": uid}, timeout=60.0, **kw)


def assert_transfer_error(response: httpx.Response, uid: str, peer: str) -> None:
    """A failed pull is a KV transfer error naming the prefill peer, which a retry may get past."""
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "kv_transfer_error" and error["code"] == 503
    assert f"KV transfer of request {uid!r} from the prefill worker failed" in error["message"], error
    assert f"prefill peer {peer} " in error["message"], error
    assert response.headers["Retry-After"] == "1"


def test_prefill_never_answers_fails_decode_after_its_deadline(short_pair: tuple[WorkerProcess, WorkerProcess]) -> None:
    # The prefill worker never got this id (its leg was lost): decode gives up at its deadline.
    prefill, decode = short_pair
    uid = uuid.uuid4().hex
    start = time.monotonic()
    response = post(f"{decode.url}/v1/completions", decode_body(BODY, uid, prefill), uid)
    assert time.monotonic() - start >= PULL_TIMEOUT_S
    assert_transfer_error(response, uid, f"127.0.0.1:{prefill.kv_port}")


def test_unknown_request_id_fails_streaming_decode_with_http_error(short_pair: tuple[WorkerProcess, WorkerProcess]) -> None:
    prefill, decode = short_pair
    uid = uuid.uuid4().hex
    response = post(f"{decode.url}/v1/completions", {**decode_body(BODY, uid, prefill), "stream": True}, uid)
    assert_transfer_error(response, uid, f"127.0.0.1:{prefill.kv_port}")


def test_dead_prefill_peer_fails_decode_after_its_deadline(short_pair: tuple[WorkerProcess, WorkerProcess]) -> None:
    prefill, decode = short_pair
    uid = uuid.uuid4().hex
    body = decode_body(BODY, uid, prefill)
    body["kv_transfer_params"]["remote_port"] = port = free_port()  # nobody listens there
    assert_transfer_error(post(f"{decode.url}/v1/completions", body, uid), uid, f"127.0.0.1:{port}")


def test_decode_never_pulls_prefill_frees_blocks_after_abort_timeout(short_pair: tuple[WorkerProcess, WorkerProcess]) -> None:
    prefill, _ = short_pair
    uid = uuid.uuid4().hex
    response = post(f"{prefill.url}/v1/completions", prefill_body(BODY, uid), uid)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1
    assert prefill.blocks_used() == 7  # ceil(100 / 16): held for the pull that never comes
    assert prefill.metric("neuron_di_requests_transferring") == 1
    start = time.monotonic()
    prefill.wait_blocks_free(timeout=ABORT_TIMEOUT_S + 10)
    assert time.monotonic() - start <= ABORT_TIMEOUT_S + 5
    assert prefill.metric("neuron_di_requests_transferring") == 0


def test_duplicate_request_id_is_refused_without_corruption(short_pair: tuple[WorkerProcess, WorkerProcess],
                                                            both_worker: WorkerProcess) -> None:
    prefill, decode = short_pair
    uid = uuid.uuid4().hex
    assert post(f"{prefill.url}/v1/completions", prefill_body(BODY, uid), uid).status_code == 200
    other = {**BODY, "prompt": list(range(200, 230))}
    again = post(f"{prefill.url}/v1/completions", prefill_body(other, uid), uid)
    assert again.status_code == 400, again.text
    assert f"request id {uid!r} is already in use" in again.json()["error"]["message"]
    response = post(f"{decode.url}/v1/completions", decode_body(BODY, uid, prefill), uid)
    want = post(f"{both_worker.url}/v1/completions", BODY, uuid.uuid4().hex)
    assert response.status_code == 200, response.text
    assert response.json()["choices"] == want.json()["choices"]


def test_duplicate_decode_leg_is_refused(short_pair: tuple[WorkerProcess, WorkerProcess], both_worker: WorkerProcess) -> None:
    prefill, decode = short_pair
    uid = uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, f"{decode.url}/v1/completions", decode_body(BODY, uid, prefill), uid)
        wait_until(lambda: decode.blocks_used() > 0, timeout=PULL_TIMEOUT_S)  # it is pulling now
        again = post(f"{decode.url}/v1/completions", decode_body(BODY, uid, prefill), uid)
        assert again.status_code == 400, again.text
        assert f"request id {uid!r} is already in use" in again.json()["error"]["message"]
        assert post(f"{prefill.url}/v1/completions", prefill_body(BODY, uid), uid).status_code == 200
        response = first.result(timeout=60)
    want = post(f"{both_worker.url}/v1/completions", BODY, uuid.uuid4().hex)
    assert response.status_code == 200, response.text
    assert response.json()["choices"] == want.json()["choices"]


def test_client_leaving_during_the_pull_frees_decode_blocks(short_pair: tuple[WorkerProcess, WorkerProcess]) -> None:
    prefill, decode = short_pair
    uid = uuid.uuid4().hex
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{decode.url}/v1/completions", json=decode_body(BODY, uid, prefill),
                   headers={"X-Request-Id": uid}, timeout=httpx.Timeout(60.0, read=0.5))
    decode.wait_blocks_free(timeout=1.5)  # freed by the abort, not by the deadline
