"""KV-aware routing's sans-I/O parts with plain lists and bytes: the event wire format and the per-worker
index (vLLM's own encoder is checked in tests/vllm/test_kv_events.py; the choice in test_kv_choice.py)."""
from __future__ import annotations

import asyncio
import json
import random

import msgpack
import pytest
from prometheus_client import CollectorRegistry

from common.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventsConfig, KVEventsError,
                              decode_frames, encode_batch)
from common.tokenizer import Tokenizer
from common.worker_record import OUR_SERVER, WorkerRecord
from proxy import COMPLETIONS, parse_request
from proxy.kv_index import KVIndexes, WorkerKVIndex, prompt_hashes
from proxy.kv_route import KVRouter, KVRoutingConfig
from proxy.prompt_tokens import encoding_of, prompt_token_ids
from proxy.workers import WorkerPool
from scheduler import BlockManager
from scheduler.sequence import Sequence

BS = 4


def stored(tokens: list[int], hashes: list[object], parent: object = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS)


def test_frames_round_trip() -> None:
    events = [stored(list(range(8)), [11, 12]), BlockRemoved((12,)), AllBlocksCleared()]
    batch = decode_frames(encode_batch(7, events, b"t", ts=1.5))
    assert batch == EventBatch(7, 1.5, tuple(events))


@pytest.mark.parametrize("frames", [
    [b"", b"x"], [b"", (1).to_bytes(8, "big"), b"\xc1garbage"],
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "Nope"}], None])],
    [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                                        "parent_block_hash": None, "token_ids": [1, 2],
                                                        "block_size": 4}]])],
    [b"", (1).to_bytes(8, "big"), msgpack.packb({"not": "a batch"})]])
def test_garbage_frames_are_a_clear_error(frames: list[bytes]) -> None:
    with pytest.raises(KVEventsError):
        decode_frames(frames)


def test_events_config_reads_vllms_json() -> None:
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}')
    assert cfg is not None and cfg.connect_endpoint("10.0.0.2") == "tcp://10.0.0.2:5557"
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    for bad in ("nope", "[1]", '{"enable_kv_cache_events": true, "endpoint": "ipc:///x"}'):
        with pytest.raises(KVEventsError):
            KVEventsConfig.parse(bad)


def test_index_matches_prompts_whatever_the_engine_hash() -> None:
    tokens = list(range(12))
    a, b = WorkerKVIndex(), WorkerKVIndex()
    a.apply(EventBatch(0, 0, (stored(tokens[:8], [1, 2]),)))
    b.apply(EventBatch(0, 0, (stored(tokens[:4], [b"x"]), stored(tokens[4:12], [b"y", b"z"], b"x"))))
    own = prompt_hashes(tokens, BS)
    assert (a.matched_blocks(own), b.matched_blocks(own)) == (2, 3)
    b.apply(EventBatch(1, 0, (BlockRemoved((b"y",)),)))
    assert b.matched_blocks(own) == 1
    b.apply(EventBatch(2, 0, (AllBlocksCleared(),)))
    assert len(b) == 0


def test_gap_restart_and_unknown_parent_drop_what_cannot_be_trusted() -> None:
    index = WorkerKVIndex()
    index.apply(EventBatch(0, 0, (stored([1, 2, 3, 4], [1]),)))
    assert "gap" in index.apply(EventBatch(2, 0, (stored([5, 6, 7, 8], [2], 1),)))
    assert len(index) == 0   # dropped, and the block whose parent went with it is not chained
    index.apply(EventBatch(3, 0, (stored([1, 2, 3, 4], [1]),)))
    assert "restarted" in index.apply(EventBatch(0, 0, ()))
    assert len(index) == 0


def test_index_forgets_the_least_recently_used_beyond_its_cap() -> None:
    index = WorkerKVIndex(capacity=3)
    index.apply(EventBatch(0, 0, (stored(list(range(16)), [1, 2, 3, 4]),)))
    assert len(index) == 3 and index.matched_blocks(prompt_hashes(list(range(16)), BS)) == 0
    index.apply(EventBatch(1, 0, (BlockRemoved((2, 3, 4, 99)),)))
    assert len(index) == 0


def test_our_block_manager_events_rebuild_its_cache() -> None:
    """Whatever the block manager does, the index built from its events holds exactly its cached hashes."""
    bm, log = BlockManager(num_blocks=12, block_size=BS), []
    bm.on_event = log.append
    rng = random.Random(0)
    for i in range(40):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        seq = Sequence(f"r{i}", prompt, max_tokens=1, block_size=BS)
        if bm.can_allocate(seq):
            bm.allocate(seq)
            bm.commit(seq, len(seq))
            bm.free(seq)
    index = WorkerKVIndex()
    index.apply(EventBatch(0, 0, tuple(log)))
    assert sorted(index._own) == sorted(bm.hash_to_block_id)


def test_indexes_count_whole_blocks_but_never_the_last_tokens_block() -> None:
    indexes = KVIndexes()
    indexes.index("w").apply(EventBatch(0, 0, (stored(list(range(8)), [1, 2]),)))
    assert indexes.overlaps(list(range(8)), ["w", "unknown"]) == [4, 0]
    assert indexes.overlaps(list(range(9)), ["w"]) == [8]
    assert indexes.overlaps(list(range(9)), ["w"], last_block_computed=False) == [8]


@pytest.mark.parametrize("argv, message", [
    (["--routing", "kv"], "needs --tokenizer"),
    (["--kv-events", "127.0.0.1:1=tcp://127.0.0.1:2"], "only with --routing kv"),
    (["--routing", "kv", "--tokenizer", "builtin", "--kv-events", "nonsense"], "HOST:PORT=tcp://"),
    (["--routing", "kv", "--tokenizer", "builtin", "--mode", "colocated", "--worker", "127.0.0.1:1"], "di mode")])
def test_routing_flags_that_do_not_fit_are_refused(argv: list[str], message: str) -> None:
    from proxy import ConfigError, parse_args
    base = [] if "--worker" in argv else ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]
    with pytest.raises(ConfigError, match=message):
        parse_args(base + argv)


def test_routing_kv_with_a_tokenizer_and_static_endpoints() -> None:
    from proxy import parse_args
    config = parse_args(["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--routing", "kv", "--tokenizer",
                         "builtin", "--kv-events", "127.0.0.1:1=tcp://127.0.0.1:5557"])
    assert config.kv_routing is not None and config.kv_routing.static_endpoints == (("127.0.0.1:1", "tcp://127.0.0.1:5557"),)
    assert parse_args(["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]).kv_routing is None


def test_each_worker_is_matched_with_the_prompt_as_its_server_encodes_it() -> None:
    """Our worker starts a completion prompt with the BOS; `vllm serve` on the built-in model adds none: the
    router looks up each worker's index with that worker's ids, and picks the one holding the prompt."""
    tokenizer, text = Tokenizer.builtin(), "the same prompt, two ways of encoding it " * 4
    request = parse_request(COMPLETIONS, json.dumps({"model": "m", "prompt": text}).encode(), True)
    ours, theirs = WorkerRecord("prefill", "h", 1, server=OUR_SERVER), WorkerRecord("prefill", "h", 2)
    ids = {server: prompt_token_ids(request, tokenizer, encoding_of(w)) for server, w in (("ours", ours),
                                                                                           ("vllm", theirs))}
    assert ids["ours"] == [tokenizer.bos_token_id, *ids["vllm"]]
    assert ids["vllm"] == tokenizer.encode_with_specials(text)
    for holder in (ours, theirs):
        indexes = KVIndexes()
        held = ids["ours" if holder is ours else "vllm"]
        n = len(held) // BS
        indexes.index(holder.key).apply(EventBatch(0, 0.0, (stored(held[:n * BS], list(range(n))),)))
        pool = WorkerPool([ours, theirs, WorkerRecord("decode", "h", 3)])
        router = KVRouter(KVRoutingConfig(tokenizer), pool, indexes, lambda _: 0, CollectorRegistry())
        assert [asyncio.run(router.picks(request)).prefill for _ in range(2)] == [holder, holder]
