"""The proxy's follower of KV events against a real ZMQ PUB socket: good batches fill the index; garbage and
out-of-order frames are counted, drop that worker's index, and the next batches fill it again."""
from __future__ import annotations

import asyncio

import zmq
from prometheus_client import CollectorRegistry

from common.kv_events import BlockStored, encode_batch
from common.worker_record import WorkerRecord
from proxy.kv_events_follower import KVEventMetrics, KVEventsFollower
from proxy.kv_index import KVIndexes
from stack.serving import free_port

BS = 4


def batch(seq: int, first: int) -> list[bytes]:
    return encode_batch(seq, [BlockStored((first,), None, tuple(range(first, first + BS)), BS)])


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def scenario() -> tuple[KVEventMetrics, CollectorRegistry]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    registry = CollectorRegistry()
    metrics, indexes = KVEventMetrics(registry), KVIndexes()
    follower = KVEventsFollower(indexes, metrics, {"127.0.0.1:9": endpoint})
    worker = WorkerRecord("prefill", "127.0.0.1", 9)
    follower.sync([worker])
    index = indexes.index(worker.key)
    try:
        seq = 0
        while len(index) == 0:         # a SUB socket misses what is sent before it joined: send until it reads
            pub.send_multipart(batch(seq, 100))
            seq += 1
            await asyncio.sleep(0.02)
        index.next_seq = None          # the joining batches were numbered as they came
        pub.send_multipart(batch(1000, 200))
        await until(lambda: len(index) == 2)
        pub.send_multipart([b"", b"not eight", b"x"])
        await until(lambda: metrics.bad_frames.labels("127.0.0.1:9")._value.get() == 1 and len(index) == 0)
        pub.send_multipart(batch(5, 300))                       # after a bad frame: any seq starts again
        await until(lambda: len(index) == 1)
        pub.send_multipart(batch(3, 400))                       # out of order: dropped, then this batch applied
        await until(lambda: metrics.resets.labels("127.0.0.1:9")._value.get() == 2 and len(index) == 1)
        pub.send_multipart(batch(4, 500))
        await until(lambda: len(index) == 2)
        follower.sync([])                                       # the worker left: unfollowed, forgotten
        assert indexes._by_worker == {}
    finally:
        await follower.close()
        pub.close(linger=0)
    return metrics, registry


def test_bad_and_out_of_order_frames_drop_the_index_and_it_refills() -> None:
    metrics, _ = asyncio.run(scenario())
    assert metrics.batches.labels("127.0.0.1:9")._value.get() >= 5
