"""Load for a fault campaign: prompts, the reference outputs, concurrent clients, and the tally.

Half the clients stream, half do not; prompts are 10-800 random printable token ids (or as a scenario
says), greedy, `ignore_eos`, so every answer that succeeds must equal the reference text
exactly: the output of one `--role both` worker for the same prompt, asked once per prompt.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import httpx

from faults.clients import CUT, ERROR, HUNG, OK, Outcome, call
from benchmarks.serving_load import LoadSpec, SyntheticRequest, make_requests
from stack.serving import Stack, StackOptions, free_port, started, wait_healthy, worker_args

MODEL = "neuron-di-builtin"


@dataclass(frozen=True, slots=True)
class LoadSize:
    """How hard a scenario pushes: requests per load phase, clients at once, each call's deadline."""

    requests: int
    concurrency: int
    deadline_s: float = 120.0


def prompts(count: int, seed: int, input_len: tuple[int, int] = (10, 800),
            output_len: tuple[int, int] = (1, 32)) -> list[SyntheticRequest]:
    return make_requests(LoadSpec(num_prompts=count, input_len=input_len, output_len=output_len, seed=seed))


def body(request: SyntheticRequest, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}


class Reference:
    """Greedy outputs of one `both` worker, each prompt asked once (a context manager)."""

    def __init__(self, options: StackOptions = StackOptions()) -> None:
        port = free_port()

        def build(stack: Stack) -> None:
            stack.start("reference worker", worker_args("both", port, options))
            wait_healthy(f"http://127.0.0.1:{port}/health", stack.processes, options.startup_timeout_s)

        self._stack = started(build)
        self._url = f"http://127.0.0.1:{port}/v1/completions"
        self._texts: dict[tuple[tuple[int, ...], int], str] = {}

    async def texts(self, requests: Sequence[SyntheticRequest]) -> list[str]:
        missing = list({_key(r): r for r in requests if _key(r) not in self._texts}.values())
        gate = asyncio.Semaphore(4)
        async with httpx.AsyncClient(timeout=120.0) as client:
            async def one(request: SyntheticRequest) -> None:
                async with gate:
                    reply = await client.post(self._url, json=body(request, False))
                reply.raise_for_status()
                self._texts[_key(request)] = reply.json()["choices"][0]["text"]
            await asyncio.gather(*(one(r) for r in missing))
        return [self._texts[_key(r)] for r in requests]

    def close(self) -> None:
        self._stack.__exit__(None, None, None)

    def __enter__(self) -> Reference:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _key(request: SyntheticRequest) -> tuple[tuple[int, ...], int]:
    return tuple(request.prompt_token_ids), request.output_len


class Load:
    """`requests` sent by `size.concurrency` clients, streamed or not as `stream` says (None:
    alternately); a stream reader waits `read_delay_s` between events."""

    def __init__(self, url: str, requests: Sequence[SyntheticRequest], size: LoadSize,
                 stream: bool | None = None, read_delay_s: float = 0.0) -> None:
        self.url = url.rstrip("/") + "/v1/completions"
        self.requests = list(requests)
        self.size = size
        self.stream = stream
        self.read_delay_s = read_delay_s
        self.outcomes: list[Outcome | None] = [None] * len(self.requests)

    @property
    def done(self) -> int:
        return sum(o is not None for o in self.outcomes)

    async def run(self) -> Load:
        gate = asyncio.Semaphore(self.size.concurrency)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        # httpx's own timeout is longer than the deadline: a call still open at its deadline is hung.
        async with httpx.AsyncClient(timeout=self.size.deadline_s + 30, limits=limits) as client:
            async def one(i: int, request: SyntheticRequest) -> None:
                async with gate:
                    stream = i % 2 == 0 if self.stream is None else self.stream
                    self.outcomes[i] = await call(client, self.url, body(request, stream),
                                                  self.size.deadline_s, self.read_delay_s)
            await asyncio.gather(*(one(i, r) for i, r in enumerate(self.requests)))
        return self

    async def wait_done(self, count: int, timeout_s: float) -> None:
        """Returns once `count` calls have ended (or the timeout passed: the fault comes anyway)."""
        deadline = time.monotonic() + timeout_s
        while self.done < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


@dataclass
class Tally:
    """Verdicts of every call of one scenario."""

    sent: int = 0
    ok: int = 0
    clear_error: int = 0
    hung: int = 0
    wrong: int = 0
    unclear: int = 0
    problems: list[str] = field(default_factory=list)  # the first few hung, wrong and unclear calls
    errors: list[str] = field(default_factory=list)    # the first few clear errors, for the record

    def add_all(self, outcomes: Iterable[Outcome]) -> None:
        """Counts calls that have no reference output to match (bad input, clients that left)."""
        for outcome in outcomes:
            self.add(outcome)

    def add(self, outcome: Outcome, want: str | None = None, cut_is_clear: bool = False) -> None:
        """Counts one call; `want` is the reference text of a completion (None: no output check)."""
        self.sent += 1
        if outcome.verdict == OK:
            if want is None or outcome.text == want:
                self.ok += 1
                return
            self.wrong += 1
            self._note(f"wrong output: got {outcome.text!r}, want {want!r}")
        elif outcome.verdict == ERROR or (outcome.verdict == CUT and cut_is_clear):
            self.clear_error += 1
            if len(self.errors) < 10:
                self.errors.append(f"{outcome.verdict}: HTTP {outcome.status}: {outcome.detail}"[:300])
        elif outcome.verdict == HUNG:
            self.hung += 1
            self._note(outcome.detail)
        else:
            self.unclear += 1
            self._note(f"{outcome.verdict}: {outcome.detail}")

    async def add_load(self, load: Load, reference: Reference, cut_is_clear: bool = False) -> None:
        wants = await reference.texts(load.requests)
        for outcome, want in zip(load.outcomes, wants):
            assert outcome is not None, "a load is judged after it ran"
            self.add(outcome, want, cut_is_clear)

    def _note(self, problem: str) -> None:
        if len(self.problems) < 10:
            self.problems.append(problem[:300])
