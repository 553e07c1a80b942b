"""--mode colocated: one leg per request, plain round-robin over `both` workers, streams passed on."""
from __future__ import annotations

from typing import Callable

import httpx
import openai

from tests.proxy.conftest import Server, start_fake_worker, start_proxy


def test_colocated_round_robin_and_passthrough(servers: Callable[[Server], Server]) -> None:
    workers = [servers(start_fake_worker("both")) for _ in range(2)]
    proxy = servers(start_proxy(["--mode", "colocated", *[f"--worker=127.0.0.1:{w.port}" for w in workers]]))
    via_proxy, direct = (openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
                         for url in (proxy.url, workers[0].url))
    for _ in range(2):
        whole = via_proxy.completions.create(model="fake-model", prompt="colocated", max_tokens=4)
        assert whole.choices[0].text == direct.completions.create(
            model="fake-model", prompt="colocated", max_tokens=4).choices[0].text
    streamed = [c.choices[0].delta.content or "" for c in via_proxy.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)]
    expected = [c.choices[0].delta.content or "" for c in direct.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)]
    assert streamed == expected and "".join(streamed).count(" w") == 3
    # Direct calls carry no X-Request-Id; the proxy's three went round-robin over both workers.
    proxied = [[leg["leg"] for leg in w.state()["legs"] if leg["uid"]] for w in workers]
    assert sorted(map(len, proxied)) == [1, 2]
    assert all(leg == "single" for worker_legs in proxied for leg in worker_legs)
    assert httpx.get(f"{proxy.url}/health", timeout=5).json()["workers"]["both"] == {"known": 2, "healthy": 2}
