"""Streams that survive their decode worker: 1P2D behind `proxy_server.py --resume-streams`.

A decode worker killed with SIGKILL mid-stream, then one drained (`--drain-hands-back-streams`):
every stream completes, and its text, finish reason and usage are those of one `both` worker's
answer to the same request, greedy and seeded alike (no token lost or repeated at the move).
The first decode worker also holds its handed-back streams' KV (`--hand-back-kv-port`): drained, its
streams' KV is pulled by the other one over the transfer engine; the other, drained, has its streams'
KV recomputed.
"""
from __future__ import annotations

import asyncio
import time
from typing import Iterator

import httpx
import pytest

from stack.worker_metrics import metric
from tests.faults.stream_clients import Streamed, bodies, reference, run_streams
from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.worker_process import WorkerProcess, start_workers, stop_together

DECODE_FLAGS = ["--drain-hands-back-streams", "--drain-timeout", "60"]
KV_FLAGS = [*DECODE_FLAGS, "--hand-back-kv-port", "0"]
PULLED = "neuron_di_kv_blocks_pulled_total"
SKIPPED = "neuron_di_kv_blocks_skipped_total"   # blocks a pull found in the puller's prefix cache
# Long enough that every stream is still decoding when the slowest has shown its first events: the prefill
# worker takes the 8 prompts one after another, and a decode worker runs 4 streams of 96 tokens in about 0.5 s.
STREAMS, TOKENS = 8, 256


class Stack:
    def __init__(self) -> None:
        self.workers: list[WorkerProcess] = []
        self.proxy: Server | None = None

    def start(self) -> None:
        self.workers = start_workers(("prefill", "shm", ()), ("decode", "shm", KV_FLAGS),
                                     ("decode", "shm", DECODE_FLAGS), ("both", "shm", ()))
        self.prefill, *self.decodes, self.both = self.workers
        self.proxy = start_proxy(["--prefill", f"127.0.0.1:{self.prefill.port}:{self.prefill.kv_port}",
                                  *[f"--decode=127.0.0.1:{d.port}" for d in self.decodes],
                                  "--resume-streams", "--health-interval", "0.5"])
        self.wait_decodes(2)

    def _add(self, worker: WorkerProcess) -> WorkerProcess:
        self.workers.append(worker)
        return worker

    def wait_decodes(self, count: int) -> None:
        assert self.proxy is not None
        wait_until(lambda: httpx.get(f"{self.proxy.url}/health", timeout=5).json()["workers"]["decode"]["healthy"]
                   == count, timeout=30, what=f"{count} healthy decode workers")

    def stop(self) -> None:
        stop_together(self.proxy.process if self.proxy is not None else None, *self.workers)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    started = Stack()
    try:
        started.start()
        yield started
    finally:
        started.stop()


def _under_load(stack: Stack, act: "callable[[], None]", count: int = STREAMS, tokens: int = TOKENS,
                after: int = 4) -> tuple[list[Streamed], list[Streamed]]:
    """`count` streams through the proxy; `act()` once every one has shown `after` events; the streams and
    the `both` worker's answers to the same requests."""
    assert stack.proxy is not None
    model = httpx.get(f"{stack.both.url}/v1/models", timeout=10).json()["data"][0]["id"]
    requests = bodies(model, count, tokens, chat_every=4)
    progress = [0] * count

    async def run() -> list[Streamed]:
        streams = asyncio.ensure_future(run_streams(stack.proxy.url, requests, progress))
        await asyncio.to_thread(wait_until, lambda: min(progress) >= after or streams.done(), 60, 0.01, "tokens")
        assert not streams.done(), "the streams ended before the fault: make them longer"
        await asyncio.to_thread(act)
        return await streams

    got = asyncio.run(run())
    want = asyncio.run(reference(stack.both.url, requests))
    return got, want


def _assert_exact(got: list[Streamed], want: list[Streamed]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert not g.errors, (i, g.errors)
        assert (g.text, g.finish_reason) == (w.text, w.finish_reason), i
        assert g.usage is not None and w.usage is not None
        assert (g.usage["prompt_tokens"], g.usage["completion_tokens"]) == \
               (w.usage["prompt_tokens"], w.usage["completion_tokens"]), i


def _pulls(worker: WorkerProcess, since: float) -> str:
    """How long the moved streams' pulls took on `worker`, from its timeline (common/timeline.py)."""
    records = httpx.get(f"{worker.url}/timeline", params={"n": 64}, timeout=10).json()["requests"]
    phases = [r["phases"] for r in records if r["phases"].get("admitted", 0.0) >= since and "first_step" in r["phases"]]
    if not phases:
        return "no pull of a moved stream on the timeline"
    pull = sorted(p["lookup_answered"] - p["pull_started"] for p in phases if "lookup_answered" in p)
    ready = sorted(p["first_step"] - p["admitted"] for p in phases)
    return (f"{len(phases)} pulls of moved streams: lookup to KV in place {pull[len(pull) // 2] * 1000:.0f} ms "
            f"median, {pull[-1] * 1000:.0f} ms max; admitted to first step {ready[len(ready) // 2] * 1000:.0f} ms "
            f"median, {ready[-1] * 1000:.0f} ms max")


def _busiest(stack: Stack, picked: list[WorkerProcess]) -> WorkerProcess:
    """The decode worker running the most streams (on a loaded host the proxy may have sent every stream to one
    of the two, its health check of the other late), added to `picked`."""
    busiest = max(stack.decodes, key=lambda w: metric(w.url, "neuron_di_requests_running", 0.0))
    picked.append(busiest)
    return busiest


def _kill_one(stack: Stack, count: int, tokens: int) -> None:
    """SIGKILL to a decode worker mid-stream; it is started again afterwards."""
    assert stack.proxy is not None
    picked: list[WorkerProcess] = []
    got, want = _under_load(stack, lambda: _busiest(stack, picked).proc.kill(), count, tokens)
    _assert_exact(got, want)
    moved, [victim] = [g for g in got if g.moves], picked
    assert moved, "no stream was on the killed worker mid-answer"
    assert metric(stack.proxy.url, "proxy_stream_moves_total", 0.0, reason="worker_lost") >= len(moved)
    for worker in (stack.prefill, *(w for w in stack.decodes if w is not victim)):
        worker.wait_blocks_free(timeout=15)
    print(f"\nkill -9, {count} streams of {tokens} tokens: {len(moved)} moved; largest gap a client saw: "
          f"{max(g.largest_gap for g in moved) * 1000:.0f} ms")
    stack.decodes[stack.decodes.index(victim)] = stack._add(victim.restarted())
    stack.wait_decodes(2)


def _drain_one(stack: Stack, count: int, tokens: int, index: int, again: bool = True, after: int = 4) -> None:
    """POST /drain to decode worker `index` once every stream showed `after` events (0 holds its streams' KV for
    a pull, 1 does not): it hands its streams back and exits; started `again` after."""
    assert stack.proxy is not None
    took: list[float] = []
    picked: list[WorkerProcess] = []
    kv = "pulled" if index == 0 else "recomputed"
    other = stack.decodes[1 - index]
    pulled: list[float] = []
    since: list[float] = []

    def drain() -> None:
        drained = stack.decodes[index]
        picked.append(drained)
        pulled.extend((metric(other.url, PULLED, 0.0), metric(other.url, SKIPPED, 0.0)))   # prompts' pulls done
        since.append(time.time())   # the wall clock, as the other worker's timeline has it
        started = time.monotonic()
        assert httpx.post(f"{drained.url}/drain", timeout=10).status_code == 202
        assert drained.proc.proc.wait(timeout=60) == 0, drained.proc.tail()
        took.append(time.monotonic() - started)

    def moves(**labels: str) -> float:
        return metric(stack.proxy.url, "proxy_stream_moves_total", 0.0, **labels)

    def gaps() -> tuple[float, float]:
        return (metric(stack.proxy.url, "proxy_stream_move_gap_seconds_sum", 0.0),
                metric(stack.proxy.url, "proxy_stream_move_gap_seconds_count", 0.0))

    before, failed, gaps_before = moves(reason="handed_back", kv=kv), moves(reason="kv_pull_failed"), gaps()
    got, want = _under_load(stack, drain, count, tokens, after)
    _assert_exact(got, want)
    moved, [drained] = [g for g in got if g.moves], picked
    assert moved and "handed back" in drained.proc.output()
    assert "drained: nothing left in flight" in drained.proc.output()   # it held nothing when it exited
    assert moves(reason="handed_back", kv=kv) - before >= len(moved)
    assert moves(reason="kv_pull_failed") == failed   # no pull of a handed-back stream's KV failed
    blocks = metric(other.url, PULLED, 0.0) - pulled[0]   # pulled from the drained worker, by the moved streams
    # A moved stream's pull covers its blocks, pulled or found in the other worker's prefix cache (an earlier test
    # sent the same prompts, and greedy streams the same tokens): at least one each.
    covered = blocks + metric(other.url, SKIPPED, 0.0) - pulled[1]
    assert covered >= len(moved) if kv == "pulled" else blocks == 0, (blocks, covered, len(moved))
    for worker in (stack.prefill, other):
        worker.wait_blocks_free(timeout=15)
    (total, n), (total0, n0) = gaps(), gaps_before
    if kv == "pulled":
        print("\n" + _pulls(other, since[0]), end="")
    print(f"\ndrain, {count} streams of {tokens} tokens, KV {kv}: {len(moved)} handed back ({blocks:.0f} KV blocks "
          f"pulled); the worker exited {took[0]:.2f} s after POST /drain; gap at the move (proxy) "
          f"{(total - total0) / max(n - n0, 1) * 1000:.0f} ms on average; largest gap a client saw: "
          f"{max(g.largest_gap for g in moved) * 1000:.0f} ms")
    if again:
        stack.decodes[stack.decodes.index(drained)] = stack._add(drained.restarted())
        stack.wait_decodes(2)


@pytest.mark.slow
def test_sixteen_long_streams_survive_a_killed_decode_worker(stack: Stack) -> None:
    _kill_one(stack, 16, 512)


@pytest.mark.slow
def test_sixteen_long_streams_survive_a_drained_decode_worker_with_their_kv(stack: Stack) -> None:
    _drain_one(stack, 16, 512, 0, after=256)   # half-way: the KV of prompt + 256 tokens moves


@pytest.mark.slow
def test_sixteen_long_streams_survive_a_drained_decode_worker_recomputed(stack: Stack) -> None:
    _drain_one(stack, 16, 512, 1, after=256)


@pytest.mark.slow
def test_a_draining_decode_worker_without_a_kv_port_has_its_streams_recomputed(stack: Stack) -> None:
    _drain_one(stack, STREAMS, TOKENS, 1)


def test_streams_of_a_killed_decode_worker_go_on_elsewhere_exactly(stack: Stack) -> None:
    _kill_one(stack, STREAMS, TOKENS)


def test_a_draining_decode_worker_hands_its_streams_and_their_kv_over(stack: Stack) -> None:
    _drain_one(stack, STREAMS, TOKENS, 0, again=False)  # the module's last test: nothing needs the worker after
