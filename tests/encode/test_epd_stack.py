"""EPD through the proxy: a real encode, prefill and decode worker behind the real proxy, against one `both`
worker that loads the same image files itself (stack/epd.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from examples.epd import answer_all, chat_body
from stack.epd import start_epd
from stack.serving import Stack, StackOptions
from stack.worker_metrics import wait_blocks_free
from tests.encode.embeds_files import write_images
from tests.helpers import wait_until
from tests.proxy.conftest import start_proxy

MODEL = "neuron-di-builtin"
CONCURRENCY = 8


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module", params=["shm", pytest.param("tcp", marks=pytest.mark.slow)])
def stack(request: pytest.FixtureRequest, media: Path) -> Iterator[Stack]:
    """KV blocks and embedding rows over `--kv-transport` shm, then tcp."""
    options = StackOptions(kv_transport=request.param, worker_extra=("--embeds-region-mb", "8"))
    with start_epd(options, media, ("--health-interval", "0.5")) as started:
        yield started


def _settled(stack: Stack) -> None:
    """Nothing is left held: KV blocks on prefill and decode, rows on the encode worker."""
    workers = {role: stack.worker_urls[role] for role in ("prefill", "decode")}
    assert wait_blocks_free(workers, timeout_s=30) == {"prefill": 0, "decode": 0}
    wait_until(lambda: httpx.get(f"{stack.worker_urls['encode']}/health", timeout=5).json()["held_parts"] == 0,
               timeout=10)


@pytest.mark.parametrize("images", [1, 2, 5])
def test_epd_answers_as_the_both_worker_token_for_token(stack: Stack, media: Path, images: int) -> None:
    bodies = []
    for i in range(CONCURRENCY):
        paths = write_images(media, [3 + (7 * i + j) % 11 for j in range(images)], first_seed=1000 * images + 10 * i)
        bodies.append(chat_body(MODEL, [p.name for p in paths], i))  # greedy and seeded, streamed and not
    bodies.append(bodies[0])  # the same images again: the prefix cache may share their KV, never others'
    epd = answer_all(stack.url, bodies, CONCURRENCY)
    both = answer_all(stack.worker_urls["both"], bodies, CONCURRENCY)
    assert [status for status, _, _ in epd] == [200] * len(bodies), epd
    assert epd == both
    assert len({text for _, text, _ in epd[:-1]}) > 1  # the images do steer the answers
    _settled(stack)


def test_encode_side_bad_input_is_the_encode_workers_400_naming_the_part(stack: Stack, media: Path) -> None:
    good = write_images(media, [4], first_seed=7)[0].name
    body = chat_body(MODEL, [good, "../outside.pt"], 0)
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages[0].content[2]" and "'..'" in error["message"], error
    _settled(stack)
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body(MODEL, [good], 0), timeout=60)
    assert reply.status_code == 200, reply.text


def test_image_embeds_parts_outside_a_disaggregated_request_are_400s(stack: Stack, media: Path) -> None:
    path = write_images(media, [3], first_seed=50)[0]
    parts = [{"part": "messages[0].content[1]", "url": path.name}]
    meta = httpx.post(f"{stack.worker_urls['encode']}/v1/encode", json={"parts": parts}, timeout=60).json()["parts"][0]
    body = chat_body(MODEL, [path.name], 0)
    body["messages"][0]["content"][1] = {"type": "image_embeds", "image_embeds": meta}
    for role in ("decode", "both"):  # a decode worker alone would compute the image from placeholders
        reply = httpx.post(f"{stack.worker_urls[role]}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 400, (role, reply.text)
        assert reply.json()["error"]["param"] == "messages[0].content[1]", (role, reply.text)
    reply = httpx.post(f"{stack.worker_urls['prefill']}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text   # served alone, a prefill worker pulls the rows itself
    _settled(stack)


def test_encode_worker_killed_before_the_pull_is_a_502_and_the_stack_keeps_serving(stack: Stack,
                                                                                  media: Path) -> None:
    paths = write_images(media, [6, 2], first_seed=77)
    parts = [{"part": f"messages[0].content[{i + 1}]", "url": p.name} for i, p in enumerate(paths)]
    encoded = httpx.post(f"{stack.worker_urls['encode']}/v1/encode", json={"parts": parts}, timeout=60)
    assert encoded.status_code == 200, encoded.text
    stack.process("encode").kill()   # its rows were made but never pulled
    body = chat_body(MODEL, [p.name for p in paths], 0)
    content = body["messages"][0]["content"]
    for i, meta in enumerate(encoded.json()["parts"]):
        content[i + 1] = {"type": "image_embeds", "image_embeds": meta}
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 502, reply.text
    message = reply.json()["error"]["message"]
    assert "messages[0].content[1]" in message and "encode worker" in message and "unreachable" in message, message
    # With the encode worker gone, image requests fail at once (502, or 503 once the health checks saw it go);
    # the rest of the stack serves on, and image requests again once an encode worker is back.
    image_body = chat_body(MODEL, [paths[0].name], 4)
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=image_body, timeout=60)
    assert reply.status_code in (502, 503) and "encode worker" in reply.json()["error"]["message"], reply.text
    workers = {role: stack.worker_urls[role] for role in ("prefill", "decode")}
    assert wait_blocks_free(workers, timeout_s=30) == {"prefill": 0, "decode": 0}
    text = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "def f(x):\n    "}]}
    assert httpx.post(f"{stack.url}/v1/chat/completions", json=text, timeout=60).status_code == 200
    stack.restart("encode")
    wait_until(lambda: httpx.post(f"{stack.url}/v1/chat/completions", json=image_body, timeout=60).status_code == 200,
               timeout=60, interval=0.5)
    _settled(stack)


@pytest.mark.parametrize("strategy", ["prefill_first", "decode_first"])
def test_epd_answers_as_the_both_worker_in_every_request_flow(stack: Stack, media: Path, strategy: str) -> None:
    """A second proxy in front of the same workers, with another --disaggregation-strategy (decode_first:
    the decode worker sends the prefill leg itself, which fetches the image rows)."""
    urls = {role: stack.worker_urls[role].removeprefix("http://") for role in ("prefill", "decode", "encode")}
    proxy = start_proxy(["--prefill", urls["prefill"], "--decode", urls["decode"], "--encode", urls["encode"],
                         "--disaggregation-strategy", strategy])
    try:
        bodies = [chat_body(MODEL, [p.name for p in write_images(media, [3, 5], first_seed=7000 + 10 * i)], i)
                  for i in range(4)]
        epd = answer_all(proxy.url, bodies, 4)
        assert [status for status, _, _ in epd] == [200] * len(bodies), epd
        assert epd == answer_all(stack.worker_urls["both"], bodies, 4)
    finally:
        proxy.process.stop()
    _settled(stack)
