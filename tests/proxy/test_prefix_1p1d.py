"""Multi-turn chats through proxy_server.py to a real prefill + decode pair with prefix caching:
each turn's answer equals a single `both` worker's, while the decode worker pulls only the prompt
blocks its prefix cache lacks (its /metrics count the blocks and bytes pulled and skipped)."""
from __future__ import annotations

from typing import Iterator

import openai
import pytest

from tests.proxy.conftest import Server, proxied_1p1d
from tests.worker_process import WorkerProcess

BLOCK = 16   # the workers' default --block-size
METRICS = ("neuron_di_kv_pulls_total", "neuron_di_kv_blocks_pulled_total", "neuron_di_kv_blocks_skipped_total",
           "neuron_di_kv_bytes_pulled_total", "neuron_di_kv_bytes_skipped_total")
USER_TURNS = ["Write a for loop over a list.", "Now make it print every item twice.",
              "And what if the list is empty?"]

Stack = tuple[Server, WorkerProcess, WorkerProcess, WorkerProcess]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with proxied_1p1d() as started:
        yield started


@pytest.fixture(autouse=True)
def blocks_free_after(stack: Stack) -> Iterator[None]:
    yield
    for worker in stack[1:]:
        worker.wait_blocks_free()


def counts(decode: WorkerProcess) -> dict[str, int]:
    return {name: decode.metric(name) for name in METRICS}


def conversation(url: str, opener: str, sampling: dict) -> list[tuple[str, int]]:
    """(answer, prompt tokens) of each turn; each turn's messages are the last turn's + its answer + new text."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    messages: list[dict[str, str]] = []
    turns = []
    for text in USER_TURNS:
        messages.append({"role": "user", "content": f"{opener} {text}"})
        reply = client.chat.completions.create(model="neuron-di-builtin", messages=messages, **sampling,
                                               extra_body={"ignore_eos": True})   # every turn has an answer
        answer = reply.choices[0].message.content or ""
        turns.append((answer, reply.usage.prompt_tokens))
        messages.append({"role": "assistant", "content": answer})
    return turns


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 21}],
                         ids=["greedy", "seeded"])
def test_multiturn_chats_equal_one_worker_and_pull_only_uncached_blocks(stack: Stack, sampling: dict) -> None:
    proxy, _, decode, both = stack
    sampling = {"max_tokens": 24, **sampling}
    for opener in (f"Chat {sampling['temperature']} one.", f"Chat {sampling['temperature']} two."):
        want = conversation(both.url, opener, sampling)
        before = counts(decode)
        assert conversation(proxy.url, opener, sampling) == want
        after = counts(decode)
        assert after["neuron_di_kv_pulls_total"] - before["neuron_di_kv_pulls_total"] == len(USER_TURNS)
        moved = after["neuron_di_kv_blocks_pulled_total"] - before["neuron_di_kv_blocks_pulled_total"]
        skipped = after["neuron_di_kv_blocks_skipped_total"] - before["neuron_di_kv_blocks_skipped_total"]
        assert moved + skipped == sum(-(-tokens // BLOCK) for _, tokens in want)
        # Turn k's prompt starts with turn k-1's, whose full blocks the decode worker kept.
        assert skipped >= sum(tokens // BLOCK for _, tokens in want[:-1])
        bytes_moved = after["neuron_di_kv_bytes_pulled_total"] - before["neuron_di_kv_bytes_pulled_total"]
        bytes_skipped = after["neuron_di_kv_bytes_skipped_total"] - before["neuron_di_kv_bytes_skipped_total"]
        assert bytes_moved * skipped == bytes_skipped * moved   # one block size: bytes count as blocks do


def test_each_turn_pulls_only_its_new_blocks(stack: Stack) -> None:
    proxy, _, decode, _ = stack
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)
    prompt, sampling = "def a():\n    return 1\n" * 8, {"max_tokens": 16, "temperature": 0.0}
    for turn in range(3):
        before = counts(decode)
        reply = client.completions.create(model="neuron-di-builtin", prompt=prompt, **sampling)
        after = counts(decode)
        skipped = after["neuron_di_kv_blocks_skipped_total"] - before["neuron_di_kv_blocks_skipped_total"]
        moved = after["neuron_di_kv_blocks_pulled_total"] - before["neuron_di_kv_blocks_pulled_total"]
        assert moved + skipped == -(-reply.usage.prompt_tokens // BLOCK)
        if turn:
            assert moved <= -(-(reply.usage.prompt_tokens - previous) // BLOCK) + 1
        previous = reply.usage.prompt_tokens
        prompt += reply.choices[0].text + f"\ndef b{turn}():\n    return {turn}\n"
