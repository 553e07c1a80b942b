"""A draining worker's refusal is resent once, leg by leg: the request is not routed again. With
conditional disaggregation, each request is counted once by path, and a prompt counts as cached on a
decode worker only if that worker was sent it (fake workers; prefill_first, so a decode leg is only
sent once a prefill worker has answered)."""
from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from tests.proxy.conftest import Server, start_fake_worker, start_proxy
from tests.proxy.flow_clients import paths

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib(n - 1)"  # 71 tokens


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Server, list[Server], list[Server], Server]]:
    """(proxy, [draining prefill, prefill], [decode, decode], single server)"""
    started: list[Server] = []
    try:
        prefills = [start_fake_worker("prefill", kv_port=15000, draining=True), start_fake_worker("prefill")]
        decodes = [start_fake_worker("decode"), start_fake_worker("decode")]
        started += [*prefills, *decodes, start_fake_worker("both")]
        proxy = start_proxy([*(a for p in prefills for a in ("--prefill", f"127.0.0.1:{p.port}:15000")),
                             *(a for d in decodes for a in ("--decode", f"127.0.0.1:{d.port}")),
                             "--disaggregation-strategy", "prefill_first", "--health-interval", "600",
                             "--conditional-disaggregation", "--tokenizer", "builtin", "--kv-block-size", "4",
                             "--max-local-prefill-tokens", "8"])
        started.append(proxy)
        yield proxy, prefills, decodes, started[4]
    finally:
        for server in started:
            server.process.stop()


def _text(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_a_refused_leg_is_resent_without_routing_the_request_again(stack) -> None:
    proxy, (draining, serving), decodes, single = stack
    body: dict[str, Any] = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 6}
    want = _text(httpx.post(f"{single.url}/v1/completions", json=body, timeout=30))
    for _ in range(4):  # two remote (one a refused prefill leg resent), then local on each decode worker
        assert _text(httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)) == want
    assert paths(proxy) == {"remote": 2, "local": 2}  # each request counted once
    assert [leg["leg"] for leg in draining.state()["legs"]] == ["prefill"]  # refused, and out of rotation
    assert [leg["leg"] for leg in serving.state()["legs"]] == ["prefill", "prefill"]
    for decode in decodes:  # a decode worker served the prompt alone only after it was sent it once
        assert [leg["leg"] for leg in decode.state()["legs"]] == ["decode", "single"]
