"""KV cache events in vLLM's wire format: what a worker publishes and the proxy's KV-aware router reads.

A publisher sends each batch as a ZMQ PUB multipart message `(topic, seq, payload)`: `seq` an 8-byte
big-endian counter from 0 (so a gap or a restart shows), `payload` a msgpack array
`[ts, [event, ...], data_parallel_rank]` whose events are maps tagged by `type`: `BlockStored`
(`block_hashes`, `parent_block_hash`, `token_ids` of every stored block in order, `block_size`, ...),
`BlockRemoved` (`block_hashes`) and `AllBlocksCleared`. That is what `vllm serve --kv-events-config`
sends, so one subscriber reads vLLM's workers and ours. Block hashes are the engine's own (an int or
bytes): a reader keys on them only to follow parents and removals.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Sequence, Union

import msgpack

from common.errors import CommonError

BlockHash = Union[int, bytes]
DEFAULT_ENDPOINT = "tcp://*:5557"   # vLLM's default


class KVEventsError(CommonError, ValueError):
    """A frame that is not a KV event batch, or a --kv-events-config that is not one."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that joined the cache, in prefix order; `parent_block_hash` is the block before the first."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[Any, ...] | None = None   # per block, what else its hash folds in (images, LoRA, salt)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KVEvent, ...]


def encode_batch(seq: int, events: Sequence[KVEvent], topic: bytes = b"", ts: float | None = None) -> list[bytes]:
    """The multipart message of one batch, as vLLM's ZmqEventPublisher sends it."""
    payload = [time.time() if ts is None else ts, [_event_map(e) for e in events], None]
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(payload, use_bin_type=True)]


def decode_frames(frames: Sequence[bytes]) -> EventBatch:
    """The batch a multipart message holds; KVEventsError naming what is wrong with it."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventsError(f"expected (topic, 8-byte seq, payload) frames, got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big", signed=True)
    try:
        payload = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        ts, raw_events = payload[0], payload[1]
        events = tuple(_event(e) for e in raw_events)
        return EventBatch(seq, float(ts), events)
    except KVEventsError:
        raise
    except Exception as exc:  # msgpack raises many types for garbage; all mean the same here
        raise KVEventsError(f"batch {seq}: not a KV event batch ({type(exc).__name__}: {exc})") from exc


def _event(obj: Any) -> KVEvent:
    kind = obj.get("type") if isinstance(obj, dict) else None
    if kind == "BlockStored":
        hashes, tokens, size = tuple(obj["block_hashes"]), tuple(obj["token_ids"]), int(obj["block_size"])
        if size < 1 or len(tokens) != len(hashes) * size:
            raise KVEventsError(f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {size}")
        extra = obj.get("extra_keys")
        return BlockStored(hashes, obj.get("parent_block_hash"), tokens, size,
                           None if extra is None else tuple(None if k is None else tuple(k) for k in extra))
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(obj["block_hashes"]))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventsError(f"unknown KV event {kind!r}")


def _event_map(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
               "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
               "block_size": event.block_size, "lora_id": None, "medium": "CPU", "lora_name": None}
        if event.extra_keys is not None:
            out["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        return out
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": "CPU"}
    return {"type": "AllBlocksCleared"}


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """The part of vLLM's --kv-events-config a publisher needs: where it binds, and its topic."""

    endpoint: str = DEFAULT_ENDPOINT
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig | None:
        """vLLM's JSON (`enable_kv_cache_events`, `publisher`, `endpoint`, `topic`; other keys are vLLM's own
        tuning); None when it does not enable events. KVEventsError for what is not such a config."""
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise KVEventsError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise KVEventsError("--kv-events-config must be a JSON object")
        if not obj.get("enable_kv_cache_events") or obj.get("publisher", "zmq") != "zmq":
            return None
        endpoint = str(obj.get("endpoint") or DEFAULT_ENDPOINT)
        if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
            raise KVEventsError(f"--kv-events-config endpoint must be tcp://HOST:PORT, got {endpoint!r}")
        return cls(endpoint, str(obj.get("topic") or ""))

    def connect_endpoint(self, host: str) -> str:
        """Where a subscriber connects: the bound endpoint with a wildcard host replaced by `host`."""
        bound_host, port = self.endpoint[6:].rsplit(":", 1)
        return f"tcp://{host if bound_host in ('*', '0.0.0.0', '') else bound_host}:{port}"
