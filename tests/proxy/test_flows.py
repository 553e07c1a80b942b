"""--disaggregation-strategy: every flow gives what one `both` worker gives.

Real workers (prefill, decode, and a `both` worker to compare with) and one proxy per strategy, and
one per strategy with conditional disaggregation: the same tokens and text, greedy and seeded,
streamed and not, completions and chat, one request at a time and 16 at once; afterwards no worker
holds a KV block.
"""
from __future__ import annotations

import asyncio
from typing import Any, Iterator

import httpx
import pytest


from proxy.flows import STRATEGIES
from tests.proxy.conftest import Server, start_proxies
from tests.proxy.flow_clients import GREEDY, SEEDED, answer, paths, request_body
from tests.worker_process import WorkerProcess, start_workers, stop_together


LOCAL_TOKENS = 32  # conditional proxies: a prompt of at most this many uncached tokens is served by decode alone


class Stack:
    """prefill + decode workers behind one proxy per strategy, and a `both` worker to compare with."""

    def __init__(self) -> None:
        self.workers: list[WorkerProcess] = []
        self.proxies: dict[str, Server] = {}
        self.workers = start_workers(*((role, "shm", ()) for role in ("prefill", "decode", "both")))
        self.prefill, self.decode, self.both = self.workers
        pair = ["--prefill-ip", "127.0.0.1", "--prefill-port", str(self.prefill.port),
                "--decode-ip", "127.0.0.1", "--decode-port", str(self.decode.port)]
        conditional = ["--conditional-disaggregation", "--tokenizer", "builtin",
                       "--max-local-prefill-tokens", str(LOCAL_TOKENS)]
        named = {**{strategy: [*pair, "--disaggregation-strategy", strategy] for strategy in STRATEGIES},
                 **{f"conditional-{strategy}": [*pair, "--disaggregation-strategy", strategy, *conditional]
                    for strategy in STRATEGIES}}
        try:
            self.proxies = dict(zip(named, start_proxies(list(named.values()))))
        except BaseException:
            stop_together(*self.workers)
            raise

    def stop(self) -> None:
        stop_together(*(proxy.process for proxy in self.proxies.values()), *self.workers)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    started = Stack()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(autouse=True)
def blocks_free_after(stack: Stack) -> Iterator[None]:
    yield
    for worker in stack.workers:
        worker.wait_blocks_free()


async def _answers(url: str, requests: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str, dict]]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=len(requests))) as client:
        return await asyncio.gather(*(answer(client, url, path, body) for path, body in requests))


def _same_as_one_worker(stack: Stack, strategy: str,
                        requests: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str, dict]]:
    """The proxy's answers with `strategy` are the `both` worker's (some may be empty: EOS at token one)."""
    want = asyncio.run(_answers(stack.both.url, requests))
    assert all(finish in ("stop", "length") for _, finish, _ in want)
    assert asyncio.run(_answers(stack.proxies[strategy].url, requests)) == want
    return want


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_flow_answers_as_one_worker(stack: Stack, strategy: str, chat: bool, stream: bool,
                                         sampling: dict[str, Any]) -> None:
    assert _same_as_one_worker(stack, strategy, [request_body(chat, stream, sampling)])[0][0]


def _mixed(count: int, max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """`count` different requests: completions and chat, streamed and not, greedy and seeded."""
    return [request_body(i % 2 == 1, i % 4 >= 2, {**SEEDED, "seed": 100 + i} if i % 3 else GREEDY,
                         max_tokens, f"class Thing{i}:\n    def ") for i in range(count)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sixteen_at_once_each_flow_answers_as_one_worker(stack: Stack, strategy: str) -> None:
    _same_as_one_worker(stack, strategy, _mixed(16, 12))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_many_long_answers_at_once_each_flow_answers_as_one_worker(stack: Stack, strategy: str) -> None:
    _same_as_one_worker(stack, strategy, _mixed(48, 80))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_answer_its_first_token_ends_is_one_workers_and_frees_every_block(stack: Stack, strategy: str,
                                                                            stream: bool) -> None:
    path, body = request_body(False, False, GREEDY, 1)
    first = httpx.post(f"{stack.both.url}{path}", json=body, timeout=60).json()["choices"][0]["text"]
    assert first
    # A stop string equal to the first token: the answer ends at token one, with nothing shown.
    requests = [request_body(False, stream, {**GREEDY, "stop": [first]})]
    assert _same_as_one_worker(stack, strategy, requests)[0][:2] == ("", "stop")
    for worker in stack.workers:  # at once, not after the prefill worker's abort timeout (60 s)
        worker.wait_blocks_free(timeout=10)


@pytest.mark.parametrize("concurrency", [pytest.param(1, marks=pytest.mark.slow), 16])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_flow_with_conditional_disaggregation_answers_as_one_worker(stack: Stack, strategy: str,
                                                                         concurrency: int) -> None:
    """Short prompts stay on the decode worker, long ones go the strategy's way; all answer as one worker."""
    proxy = stack.proxies[f"conditional-{strategy}"]
    requests = [request_body(i % 2 == 1, i % 4 >= 2, {**SEEDED, "seed": 300 + i} if i % 3 else GREEDY, 8,
                             f"# {strategy} {concurrency} {i}\n" + ("x = 1\n" * 40 if i % 4 in (1, 2) else "y = "))
                for i in range(max(8, concurrency))]
    before = paths(proxy)
    assert _sent(proxy.url, requests, concurrency) == _sent(stack.both.url, requests, concurrency)
    taken = {path: n - before.get(path, 0) for path, n in paths(proxy).items()}
    assert taken.get("local", 0) > 0 and taken.get("remote", 0) > 0, taken


def _sent(url: str, requests: list[tuple[str, dict[str, Any]]], concurrency: int) -> list[tuple[str, str, dict]]:
    """The answers to `requests`, all at once or (concurrency 1) one after another."""
    if concurrency > 1:
        return asyncio.run(_answers(url, requests))
    return [asyncio.run(_answers(url, [request]))[0] for request in requests]
