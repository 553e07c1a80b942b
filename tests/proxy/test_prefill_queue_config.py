"""The prefill queue's command lines (proxy and worker), and how conditional disaggregation reads its depth."""
from __future__ import annotations

import argparse

import pytest

from proxy.conditional import ConditionalPolicy, prefill_queue
from proxy.config import parse_args
from proxy.errors import ConfigError
from proxy.queued_flow import queue_legs
from worker.server import prefill_queue_flags

WORKERS = ["--prefill", "127.0.0.1:8100", "--decode", "127.0.0.1:8200"]


def test_the_proxy_takes_a_nats_url_and_is_off_by_default() -> None:
    assert parse_args(WORKERS).prefill_queue is None
    assert parse_args([*WORKERS, "--prefill-queue", "nats://127.0.0.1"]).prefill_queue == "nats://127.0.0.1:4222"
    for strategy in ("concurrent", "prefill_first", "decode_first"):
        argv = [*WORKERS, "--prefill-queue", "nats://h", "--disaggregation-strategy", strategy]
        assert parse_args(argv).prefill_queue == "nats://h:4222"


@pytest.mark.parametrize("extra, words", [
    (["--prefill-queue", "http://127.0.0.1:4222"], "expected nats://HOST:PORT"),
    (["--prefill-queue", "nats://h:4222", "--kv-protocol", "nixl"], "kv_protocol neuron"),
])
def test_the_proxy_refuses_what_the_queue_does_not_serve(extra: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_args([*WORKERS, *extra])


def worker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--role", default="prefill")
    prefill_queue_flags.add_arguments(parser)
    args = parser.parse_args(argv)
    prefill_queue_flags.check(parser, args)
    return args


def test_the_worker_flags() -> None:
    assert worker_args().prefill_queue is None
    args = worker_args("--prefill-queue", "nats://10.0.0.1:4333", "--prefill-queue-max-jobs", "4")
    assert (args.prefill_queue, args.prefill_queue_max_jobs) == ("nats://10.0.0.1:4333", 4)
    assert worker_args("--role", "decode", "--prefill-queue", "nats://h").prefill_queue == "nats://h:4222"
    for bad in (["--role", "both", "--prefill-queue", "nats://h"], ["--prefill-queue-max-jobs", "0"],
                ["--prefill-queue", "h:4222"]):
        with pytest.raises(SystemExit):
            worker_args(*bad)


@pytest.mark.parametrize("depth, workers, long", [(0, 2, False), (3, 2, False), (4, 2, True), (1, 0, True)])
def test_conditional_disaggregation_weighs_the_stream_depth_per_worker(depth: int, workers: int, long: bool) -> None:
    legs = queue_legs(depth, workers)
    assert len(legs) == workers and sum(legs) == depth * (workers > 0)
    assert (prefill_queue(legs) >= ConditionalPolicy().max_prefill_queue) == long
