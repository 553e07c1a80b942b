"""--kv-write-back with real worker processes behind a KV-routed proxy: a chat's answer KV goes back to the
prefill worker that served the prompt, the proxy hears of it from that worker's KV events and sends the next
turn there, which holds every block of the last turn's prompt and answer; the answers equal one `both`
worker's and every block comes back. By default (`chats`) only the answers of chats under way go back."""
from __future__ import annotations

import random
from typing import Any, Iterator

import httpx
import pytest

from stack.worker_metrics import metric
from tests.helpers import wait_until
from tests.proxy.conftest import Server
from tests.proxy.kv_stack import kv_routed_stack
from tests.worker_process import WorkerProcess

MODEL = "neuron-di-builtin"
BLOCK = 16


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Server, list[WorkerProcess]]]:
    with kv_routed_stack(2, 1, ["--kv-write-back"]) as served:
        yield served


@pytest.fixture(scope="module")
def default_stack() -> Iterator[tuple[Server, list[WorkerProcess]]]:
    with kv_routed_stack(1, 1) as served:
        yield served


def complete(client: httpx.Client, url: str, prompt: list[int], sampling: dict[str, Any]) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "neuron_di_token_ids": True,
            **sampling}
    reply = client.post(f"{url}/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def indexed(proxy: Server, worker: WorkerProcess) -> float:
    """The blocks the proxy's index says `worker` holds."""
    return metric(proxy.url, "proxy_kv_index_blocks", 0.0, worker=f"127.0.0.1:{worker.port}")


def written_back(workers: list[WorkerProcess]) -> float:
    return sum(metric(w.url, "neuron_di_kv_write_back_cached_blocks_total", 0.0) for w in workers[:2])


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 11}])
def test_the_next_turn_finds_the_answer_on_its_prefill_worker(stack, sampling: dict[str, Any]) -> None:
    proxy, workers = stack
    rng = random.Random(str(sampling))
    prompt = [rng.randrange(30, 230) for _ in range(150)]
    with httpx.Client(timeout=120) as client:
        for turn in range(3):
            cached = written_back(workers)
            hits = metric(proxy.url, "proxy_kv_route_tokens_total", 0.0, kind="hit")
            answer = complete(client, proxy.url, prompt, sampling)
            assert answer == complete(client, workers[-1].url, prompt, sampling), f"turn {turn}"
            if turn:   # the prefill worker picked held the last turn's prompt and answer but its newest token
                held = metric(proxy.url, "proxy_kv_route_tokens_total", 0.0, kind="hit") - hits
                assert held >= (len(prompt) - 1 - 40) // BLOCK * BLOCK, (turn, held)
            wait_until(lambda: written_back(workers) > cached, timeout=30)
            # ... and the proxy heard it: a prefill worker's index holds the chat's every full block.
            full = (len(prompt) + len(answer) - 1) // BLOCK
            wait_until(lambda: max(indexed(proxy, w) for w in workers[:2]) >= full, timeout=30)
            prompt = prompt + answer + [rng.randrange(30, 230) for _ in range(40)]
    for worker in workers:
        worker.wait_blocks_free()
    decode = workers[2]
    assert metric(decode.url, "neuron_di_kv_write_back_offers_total", 0.0) >= 3
    assert sum(metric(w.url, "neuron_di_kv_write_back_failed_total", 0.0) for w in workers[:2]) == 0


def chat(client: httpx.Client, url: str, messages: list[dict[str, str]]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": 20, "ignore_eos": True, "temperature": 0.0}
    reply = client.post(f"{url}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_by_default_only_the_answers_of_chats_under_way_are_written_back(default_stack) -> None:
    proxy, (prefill, decode, both) = default_stack

    def offers() -> float:
        return metric(decode.url, "neuron_di_kv_write_back_offers_total", 0.0)

    first = [{"role": "system", "content": "You answer in one line. " * 4}, {"role": "user", "content": "The sea?"}]
    with httpx.Client(timeout=120) as client:
        complete(client, proxy.url, [random.Random(3).randrange(30, 230) for _ in range(100)], {"temperature": 0.0})
        answer = chat(client, proxy.url, first)   # a first turn: no answer in its messages yet
        decode.wait_blocks_free()   # an offered answer's blocks would be held until pulled
        assert offers() == 0 and written_back([prefill]) == 0
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the rivers?"}]
        assert chat(client, proxy.url, second) == chat(client, both.url, second)
        wait_until(lambda: written_back([prefill]) > 0, timeout=30)
        assert offers() == 1
    for worker in (prefill, decode):
        worker.wait_blocks_free()
