"""Publishes the engine's KV cache events on a ZMQ PUB socket, in vLLM's format (common/kv_events.py).

The block manager reports each hash that joins or leaves its cache from the engine thread
(`put`, a queue put that never blocks the step); one thread owns the socket and sends whatever
has queued as one batch, numbered from 0. A new engine (start, change of role) starts with
AllBlocksCleared, so a subscriber that kept an older picture drops it.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import zmq

from common.kv_events import AllBlocksCleared, KVEvent, KVEventsConfig, encode_batch

logger = logging.getLogger("worker.kv_events")
MAX_BATCH = 1024          # events in one message
MAX_QUEUED = 1_000_000    # events waiting to be sent; beyond it they are dropped (and the seq gap shows it)


class KVEventsPublisher:
    """One PUB socket bound at `config.endpoint` and the thread that sends on it; `close` stops both."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[KVEvent | None] = queue.Queue(MAX_QUEUED)
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(config.endpoint)
        self._seq = 0
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def attach(self, engine: Any) -> None:
        """Reports `engine`'s block manager from now on, starting from an empty cache."""
        self.put(AllBlocksCleared())
        engine.scheduler.block_manager.on_event = self.put

    def put(self, event: KVEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._dropped += 1    # a skipped seq number tells subscribers to forget this worker's picture

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._socket.close(linger=0)

    def _run(self) -> None:
        topic = self.config.topic.encode()
        while True:
            event = self._queue.get()
            if event is None:
                return
            events = [event]
            while len(events) < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._send(topic, events)
                    return
                events.append(nxt)
            self._send(topic, events)

    def _send(self, topic: bytes, events: list[KVEvent]) -> None:
        if self._dropped:
            logger.warning("%d KV events dropped: the queue was full", self._dropped)
            self._dropped, self._seq = 0, self._seq + 1
        try:
            self._socket.send_multipart(encode_batch(self._seq, events, topic))
        except zmq.ZMQError:
            logger.exception("KV events batch %d not sent", self._seq)
        self._seq += 1
