"""A real `vllm serve --kv-events-config` feeds the proxy's KV index: vLLM's events decode with our reader,
and the blocks vLLM cached match the prompt's token ids under the proxy's own hash (vLLM hashes differently),
the ids the proxy encodes the prompt to as `vllm serve` does (no BOS on the built-in model, unlike ours)."""
from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
from prometheus_client import CollectorRegistry
from vllm.distributed import kv_events as vllm_events

from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_frames, encode_batch
from common.tokenizer import Tokenizer
from common.worker_record import OUR_SERVER, WorkerRecord
from proxy import COMPLETIONS, parse_request
from proxy.kv_events_follower import KVEventMetrics, KVEventsFollower
from proxy.kv_index import KVIndexes
from proxy.kv_route import KVRouter, KVRoutingConfig
from proxy.prompt_tokens import encoding_of, prompt_token_ids
from proxy.workers import WorkerPool
from stack.serving import Stack
from stack.vllm import SERVED_NAME
from tests.vllm.conftest import REFERENCE_EVENTS_PORT

PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 8


def test_our_frames_and_vllms_decode_alike() -> None:
    theirs = vllm_events.KVEventBatch(ts=2.0, events=[
        vllm_events.BlockStored(block_hashes=[b"\x01" * 32, 5], parent_block_hash=None, token_ids=list(range(8)),
                                block_size=4, lora_id=None, medium="GPU", lora_name=None),
        vllm_events.BlockRemoved(block_hashes=[5], medium="GPU"), vllm_events.AllBlocksCleared()])
    got = decode_frames([b"", (3).to_bytes(8, "big"), msgspec.msgpack.encode(theirs)])
    assert got == EventBatch(3, 2.0, (BlockStored((b"\x01" * 32, 5), None, tuple(range(8)), 4), BlockRemoved((5,)),
                                      AllBlocksCleared()))
    ours = msgspec.msgpack.decode(encode_batch(0, list(got.events))[2], type=vllm_events.KVEventBatch)
    assert [type(e).__name__ for e in ours.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert ours.events[0].block_hashes == [b"\x01" * 32, 5]


async def follow_and_ask(url: str) -> tuple[int, int, int, list[int], str, KVIndexes, WorkerRecord]:
    worker = WorkerRecord("prefill", "127.0.0.1", int(url.rsplit(":", 1)[1]))   # static: it shows no record
    indexes, registry = KVIndexes(), CollectorRegistry()
    follower = KVEventsFollower(indexes, KVEventMetrics(registry),
                                {worker.address: f"tcp://127.0.0.1:{REFERENCE_EVENTS_PORT}"})
    follower.sync([worker])
    index = indexes.index(worker.key)
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            deadline, ids, attempt = asyncio.get_running_loop().time() + 60, [], 0
            # A SUB socket joins late, and a prompt vLLM cached is not stored again: new prompts until one is heard.
            while not ids or not indexes.overlaps(ids, [worker.key])[0]:
                assert asyncio.get_running_loop().time() < deadline, "no KV events from vllm serve"
                prompt, attempt = f"attempt {attempt}: {PROMPT}", attempt + 1
                tokenized = await client.post(f"{url}/tokenize", json={"model": SERVED_NAME, "prompt": prompt})
                ids = tokenized.json()["tokens"]   # the ids vLLM computes the prompt's KV of
                reply = await client.post(f"{url}/v1/completions", json={
                    "model": SERVED_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0})
                assert reply.status_code == 200, reply.text
                await asyncio.sleep(0.5)
        cached = indexes.overlaps(ids, [worker.key], last_block_computed=False)[0]
        return cached, index.block_size, registry.get_sample_value("proxy_kv_event_bad_frames_total",
                                                                   {"worker": worker.address}) or 0, ids, prompt, \
            indexes, worker
    finally:
        await follower.close()


def test_vllm_serve_events_feed_the_index(reference: Stack) -> None:
    cached, block_size, bad, ids, prompt, indexes, worker = asyncio.run(follow_and_ask(reference.url))
    assert block_size > 0 and bad == 0 and len(ids) >= 2 * block_size
    assert cached == len(ids) // block_size * block_size   # every full block of the prompt, matched by our hash
    # The proxy's KV routing encodes the prompt as `vllm serve` does, finds its prefix there, and picks it.
    request = parse_request(COMPLETIONS, json.dumps({"model": SERVED_NAME, "prompt": prompt}).encode(), True)
    tokenizer = Tokenizer.builtin()
    assert prompt_token_ids(request, tokenizer, encoding_of(worker)) == ids
    assert indexes.overlaps(prompt_token_ids(request, tokenizer, OUR_SERVER), [worker.key])[0] == 0   # BOS first
    pool = WorkerPool([WorkerRecord("prefill", "127.0.0.1", 1), worker, WorkerRecord("decode", "127.0.0.1", 2)])
    registry = CollectorRegistry()
    router = KVRouter(KVRoutingConfig(tokenizer), pool, indexes, lambda _: 0, registry)
    for _ in range(2):   # whichever worker's turn it is
        assert asyncio.run(router.picks(request)).prefill == worker
    hit = registry.get_sample_value("proxy_kv_route_tokens_total", {"kind": "hit"})
    assert hit == 2 * ((len(ids) - 1) // block_size * block_size), hit   # all but the block of the last token
