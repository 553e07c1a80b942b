"""The proxy's encode step: its command line, the pure swap of image parts, and encode workers found in
a real etcd (a real `python -m worker --role encode` registering itself)."""
from __future__ import annotations

import httpx
import pytest

from proxy import ConfigError, NoWorkers, WorkerPool, WorkerRecord, parse_args
from proxy.encode import image_parts, with_embeds
from stack.etcd import EtcdServer
from tests.helpers import wait_until
from tests.proxy.conftest import start_proxy
from tests.worker_process import WorkerProcess


def test_config_takes_static_encode_workers_beside_prefill_and_decode() -> None:
    config = parse_args(["--prefill", "a:1", "--decode", "b:2", "--encode", "e:3", "--encode", "f:4"])
    assert [(w.role, w.address) for w in config.workers] == [
        ("prefill", "a:1"), ("decode", "b:2"), ("encode", "e:3"), ("encode", "f:4")]
    for argv, message in [(["--encode", "e:3"], "give those too"),
                          (["--prefill", "a:1", "--decode", "b:2", "--encode", "e"], "expected HOST:PORT"),
                          (["--mode", "colocated", "--worker", "w:1", "--encode", "e:3"], "takes --worker"),
                          (["--prefill", "a:1", "--decode", "b:2", "--encode", "e:3", "--encode", "e:3"],
                           "given twice")]:
        with pytest.raises(ConfigError, match=message):
            parse_args(argv)


def test_encode_workers_take_turns_and_are_records_like_the_others() -> None:
    workers = [WorkerRecord("encode", "e", 3), WorkerRecord("encode", "f", 4)]
    assert WorkerRecord.from_json(workers[0].to_json()) == workers[0] and workers[0].key == "/workers/encode/e/3"
    pool = WorkerPool([*workers, WorkerRecord("prefill", "a", 1)])
    assert [pool.next("encode").address for _ in range(3)] == ["e:3", "f:4", "e:3"]
    pool.mark(workers[0].key, healthy=False)
    pool.mark(workers[1].key, healthy=False)
    with pytest.raises(NoWorkers, match="no healthy encode worker"):
        pool.next("encode")


def test_image_parts_are_found_in_order_and_swapped_in_a_copy() -> None:
    body = {"model": "m", "messages": [
        {"role": "system", "content": "plain"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "image_url", "image_url": {"url": "y"}}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "z"}}]}]}
    parts = image_parts(body)
    assert parts == [(1, 1, "x"), (1, 2, "y"), (2, 0, "z")]
    swapped = with_embeds(body, parts, [{"m": 1}, {"m": 2}, {"m": 3}])
    assert swapped["messages"][1]["content"][1:] == [{"type": "image_embeds", "image_embeds": {"m": 1}},
                                                     {"type": "image_embeds", "image_embeds": {"m": 2}}]
    assert swapped["messages"][2]["content"] == [{"type": "image_embeds", "image_embeds": {"m": 3}}]
    assert swapped["messages"][0] == body["messages"][0] and swapped["model"] == "m"
    assert body["messages"][1]["content"][1]["type"] == "image_url"  # the client's body is left as it was
    assert image_parts({"messages": [{"role": "user", "content": "no parts"}]}) == []


def test_an_encode_worker_registers_in_etcd_and_the_proxy_follows_it(etcd_server: EtcdServer) -> None:
    proxy = start_proxy(["--etcd", etcd_server.endpoint, "--health-interval", "0.5"])
    encode = None
    try:
        encode = WorkerProcess("encode", "shm", extra=["--etcd", etcd_server.endpoint])

        def encode_workers() -> dict | None:
            return httpx.get(f"{proxy.url}/health", timeout=5).json()["workers"].get("encode")
        wait_until(lambda: encode_workers() == {"known": 1, "healthy": 1}, timeout=20)
        encode.stop()  # SIGTERM: the worker revokes its record
        wait_until(lambda: encode_workers() is None, timeout=20)
    finally:
        if encode is not None:
            encode.stop()
        proxy.process.stop()
