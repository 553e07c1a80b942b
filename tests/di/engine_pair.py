"""Both legs of requests stepped through an in-process prefill engine and decode engine."""
from __future__ import annotations

import random
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from common.handoff import parse_leg
from stack.serving import free_port
from worker import EngineConfig, LLMEngine, SamplingParams
from worker.engine.kv_connector import KVConnector, KVConnectorConfig


@contextmanager
def engine_trio(num_blocks: int, dtype: str = "float32", decode_dtype: str | None = None, write_back: str = "off",
                prefill_write_back: str | None = None,
                **decode_config: Any) -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    """A prefill and a decode engine over shm, and a `both` engine to compare with, computing in `dtype`
    (the decode engine in `decode_dtype` if given; `write_back`: which answers' KV goes back to the prefill engine,
    whose own mode is `prefill_write_back` if given); closed on the way out."""
    torch.set_num_threads(1)
    takes = write_back if prefill_write_back is None else prefill_write_back
    prefill = LLMEngine(EngineConfig(role="prefill", num_kv_blocks=num_blocks, dtype=dtype),
                        kv_connector=KVConnector(KVConnectorConfig("prefill", "shm", kv_port=free_port(),
                                                                   write_back=takes)))
    decode = LLMEngine(EngineConfig(role="decode", num_kv_blocks=num_blocks, dtype=decode_dtype or dtype,
                                     **decode_config),
                       kv_connector=KVConnector(KVConnectorConfig("decode", "shm", write_back=write_back,
                                                                  engine_id=f"decode-{time.monotonic_ns()}")))
    both = LLMEngine(EngineConfig(num_kv_blocks=num_blocks, dtype=dtype))
    try:
        yield prefill, decode, both
    finally:
        prefill.close()
        decode.close()


def run_pair(prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]],
             params: list[SamplingParams], tag: str = "") -> tuple[list[int], list[list[int]]]:
    """Both legs of every request, stepped until decode finished them all; (first tokens, outputs)."""
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {f"{tag or time.monotonic_ns()}-{i}": [] for i in range(len(prompts))}
    for (rid, prompt), p in zip(zip(tokens, prompts), params):
        leg = SamplingParams(max_tokens=1, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                             ignore_eos=p.ignore_eos)
        prefill.add_request(rid, prompt, leg, parse_leg({"role": "prefill", "request_id": rid}))
        decode.add_request(rid, prompt, p, parse_leg({"role": "decode", "request_id": rid, "remote_host": "127.0.0.1",
                                                      "remote_port": prefill.kv_connector.kv_port}))
    unfinished, deadline = set(tokens), time.monotonic() + 120
    while unfinished:
        assert time.monotonic() < deadline, f"still unfinished: {sorted(unfinished)}"
        for out in prefill.step():
            assert out.error is None
            first[out.request_id] = out.new_token_ids[0]
        for out in decode.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                unfinished.discard(out.request_id)
    return [first[rid] for rid in tokens], list(tokens.values())


def wait_all_free(*engines: LLMEngine) -> None:
    deadline = time.monotonic() + 30
    while any(e.stats().num_blocks_used for e in engines):
        assert time.monotonic() < deadline, [e.stats() for e in engines]
        for engine in engines:
            engine.step()  # takes the connector's releases
        time.sleep(0.01)


class Recorder:
    """What the decode engine pulled and what the prefill engine computed, through their real hooks."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine) -> None:
        self.pulls: list[tuple[int, int]] = []              # (blocks pulled, blocks skipped) per pull
        self.prefill_starts: list[int] = []                 # first position each prefill chunk computed
        self._prefill, self._decode = prefill, decode
        self._run = prefill.runner.run

    def __enter__(self) -> Recorder:
        self._decode.kv_connector.on_pull = lambda pulled, skipped, block_bytes: self.pulls.append((pulled, skipped))

        def run(step):  # the real runner, noting where each prompt chunk starts
            self.prefill_starts.extend(c.start for c in step.chunks)
            return self._run(step)

        self._prefill.runner.run = run
        return self

    def __exit__(self, *exc: object) -> None:
        self._prefill.runner.run = self._run
        self._decode.kv_connector.on_pull = lambda pulled, skipped, block_bytes: None


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(30, 230) for _ in range(n)]
