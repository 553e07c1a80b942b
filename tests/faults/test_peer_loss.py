"""A worker's signal-plane peer dies: what was held for it is freed within seconds, not at a timeout.

Real worker processes over tcp, legs sent by hand as the proxy sends them (no proxy to abort what
it abandoned, so only the workers' own detection frees anything), and one restart behind a proxy:

- a decode worker killed -9: its prefill peer frees the blocks held for it (the prefill legs named it)
  when its session goes, not at --kv-abort-timeout (60 s);
- a prefill worker killed -9: its decode peer fails the pulls from it at once and frees their blocks,
  not at the pull deadline plus its grace (35 s);
- a prefill worker restarted at its address with its --engine-id under load: no answer differs from
  one `both` worker's, and no block stays held (slow);
- a decode worker back with its --engine-id as another process: the prefill frees what the old life was to
  pull at the new life's first session, and hands it none of it (slow).

Each wait polls with a deadline far below those timeouts; the measured seconds are printed (-s).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from typing import Iterator

import httpx
import pytest

from faults.load import Load, LoadSize, Reference, Tally, prompts
from tests.di.workers import decode_body, disaggregated, prefill_body
from tests.helpers import wait_until
from tests.proxy.conftest import start_proxy
from tests.worker_process import WorkerProcess, start_workers

FREED_WITHIN_S = 10.0   # a generous deadline for what the workers free within a few seconds
BODY = {"model": "neuron-di-builtin", "prompt": list(range(50, 90)), "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}
LEGS = 4


@pytest.fixture(scope="module")
def decode() -> Iterator[WorkerProcess]:
    worker = WorkerProcess("decode", "tcp")
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def prefill() -> Iterator[list[WorkerProcess]]:
    """The module's prefill worker, in a list: the restart test replaces it (the same --engine-id in both
    lives), the last test kills it."""
    workers = [WorkerProcess("prefill", "tcp", ["--engine-id", "prefill-kept"])]
    try:
        yield workers
    finally:
        workers[0].stop()


def _one_request(prefill: WorkerProcess, decode: WorkerProcess) -> None:
    """One request through both workers: the decode worker's session on the prefill worker is up."""
    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            return await disaggregated(client, prefill, decode, "/v1/completions", BODY)
    for reply in asyncio.run(run()):
        assert reply.status_code == 200, reply.text


def _freed(worker: WorkerProcess, since: float, what: str) -> float:
    wait_until(lambda: worker.blocks_used() == 0, timeout=FREED_WITHIN_S, interval=0.05, what=what)
    took = time.monotonic() - since
    print(f"{what}: {took:.2f} s")
    return took


# Slow (a proxy, a reference worker and a restart: ~40 s here); by default tests/di/test_restart.py restarts a
# prefill worker and tests/neuron_connector/test_two_processes.py fails the old process's pulls at its loss.
@pytest.mark.slow
def test_a_prefill_worker_restarted_at_its_address_mid_load_gives_no_wrong_answer_and_holds_no_block(
        prefill: list[WorkerProcess], decode: WorkerProcess) -> None:
    proxy = start_proxy(["--prefill-ip", "127.0.0.1", "--prefill-port", str(prefill[0].port), "--prefill-kv-port",
                         str(prefill[0].kv_port), "--decode-ip", "127.0.0.1", "--decode-port", str(decode.port),
                         "--health-interval", "0.5"])
    requests, size = 24, LoadSize(requests=24, concurrency=4, deadline_s=120.0)
    load = Load(proxy.url, prompts(requests, seed=31, input_len=(20, 300), output_len=(8, 40)), size)
    after = Load(proxy.url, prompts(requests, seed=32, input_len=(20, 300), output_len=(8, 40)), size)
    try:
        async def run() -> None:
            running = asyncio.ensure_future(load.run())
            await load.wait_done(requests // 4, timeout_s=120)
            prefill[0].proc.kill()
            prefill[0] = await asyncio.to_thread(prefill[0].restarted)
            await running
            await asyncio.to_thread(wait_until, lambda: httpx.get(f"{proxy.url}/ready", timeout=5).status_code == 200,
                                    timeout=30, what="the proxy seeing the restarted prefill worker")
            await after.run()

        with Reference() as reference:
            asyncio.run(run())
            tally, again = Tally(), Tally()
            asyncio.run(tally.add_load(load, reference))
            asyncio.run(again.add_load(after, reference))
        print(f"restarted prefill: {tally.ok} of {requests} answered whole, {tally.clear_error} clear errors; "
              f"after it: {again.ok} of {requests}")
        assert tally.hung == tally.wrong == tally.unclear == 0, (tally.problems, tally.errors)
        assert again.ok == requests, (again.problems, again.errors)
        ended = time.monotonic()
        for worker in (prefill[0], decode):
            _freed(worker, ended, f"after the restart, {worker.role} blocks free")
    finally:
        proxy.process.stop()


def test_a_killed_decode_worker_frees_the_prefill_blocks_held_for_it(prefill: list[WorkerProcess]) -> None:
    victim = WorkerProcess("decode", "tcp")
    try:
        _one_request(prefill[0], victim)
        assert victim.metric("neuron_di_kv_fenced_handoffs_total") == 1   # its one pull, fenced
        _hold_for(prefill[0], victim.engine_id)
        assert prefill[0].blocks_used() > 0
        killed = time.monotonic()
        victim.proc.kill()
        _freed(prefill[0], killed, "decode killed -> the prefill's blocks held for it free")
    finally:
        victim.stop()


def _hold_for(prefill: WorkerProcess, engine_id: str, count: int = LEGS) -> None:
    """Prefill legs naming decode engine `engine_id` whose decode legs never come: their KV waits for it."""
    for _ in range(count):
        uid = uuid.uuid4().hex
        body = prefill_body(BODY, uid)
        body["kv_transfer_params"]["decode_engine_id"] = engine_id
        reply = httpx.post(f"{prefill.url}/v1/completions", json=body, headers={"X-Request-Id": uid}, timeout=60)
        assert reply.status_code == 200, reply.text


def _through(prefill: WorkerProcess, decode: WorkerProcess, bodies: list[dict]) -> list[httpx.Response]:
    """Each body's two legs sent as the proxy sends them; a request that failed is aborted on the prefill
    worker, as the proxy aborts it."""
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60.0) as client:
            replies = []
            for body in bodies:
                uid = uuid.uuid4().hex
                first, rest = await disaggregated(client, prefill, decode, "/v1/completions", body, uid)
                if first.status_code != 200 or rest.status_code != 200:
                    await client.post(f"{prefill.url}/abort_request", json={"rid": uid})
                replies.append(rest)
            return replies
    return asyncio.run(run())


# Slow (three more workers and a restart: ~25 s here); by default tests/neuron_connector/test_pullers.py drives
# the incarnations by hand.
@pytest.mark.slow
def test_a_decode_worker_back_as_another_incarnation_frees_the_blocks_held_for_its_old_life(
        prefill: list[WorkerProcess]) -> None:
    """The old life frozen (its connection stays open until the heartbeats drop it) while a new process with its
    engine id asks again and again: the new life's first session frees what the old one was to pull, however
    soon it came. Then the old one killed -9 and started again at its address with its engine id: new requests
    answer as one `both` worker does, and no block stays held."""
    engine = ["--engine-id", "decode-reborn"]
    old, new, both = start_workers(("decode", "tcp", engine), ("decode", "tcp", engine), ("both", "tcp", ()))
    try:
        _one_request(prefill[0], old)
        _hold_for(prefill[0], "decode-reborn")
        held = prefill[0].blocks_used()
        os.kill(old.proc.pid, signal.SIGSTOP)
        wait_until(lambda: _through(prefill[0], new, [BODY])[0].status_code == 200, timeout=30, interval=0.1,
                   what="the new process's session (refused while the old one's connection lives)")
        _freed(prefill[0], time.monotonic(), f"new incarnation's session -> the old one's {held} blocks free")
        new.stop()
        old.proc.kill()
        old = old.restarted()
        bodies = [{**BODY, "prompt": list(range(n, n + 30 + 7 * n)), "max_tokens": 8} for n in range(1, 5)]
        want = [httpx.post(f"{both.url}/v1/completions", json=b, timeout=60).json()["choices"][0]["text"]
                for b in bodies]
        got = _through(prefill[0], old, bodies)
        assert [r.json()["choices"][0]["text"] if r.status_code == 200 else r.text for r in got] == want
        for worker in (prefill[0], old):
            _freed(worker, time.monotonic(), f"after the restart, {worker.role} blocks free")
    finally:
        for worker in (old, new, both):
            worker.stop()


def test_a_killed_prefill_worker_fails_the_decode_pulls_from_it(prefill: list[WorkerProcess],
                                                                decode: WorkerProcess) -> None:
    victim = prefill[0]   # the module's last test: nothing needs it afterwards
    try:
        _one_request(victim, decode)

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60.0) as client:
                # Decode legs whose prefill legs never come: their pulls wait on the victim.
                legs = [asyncio.ensure_future(client.post(
                    f"{decode.url}/v1/completions", json=decode_body(BODY, uid, victim), headers={"X-Request-Id": uid}))
                    for uid in (uuid.uuid4().hex for _ in range(LEGS))]
                await asyncio.to_thread(wait_until, lambda: decode.blocks_used() > 0, timeout=30, interval=0.05)
                killed = time.monotonic()
                victim.proc.kill()
                await asyncio.to_thread(_freed, decode, killed, "prefill killed -> the decode's pulls fail and free")
                return list(await asyncio.gather(*legs))
        for reply in asyncio.run(run()):
            assert reply.status_code >= 500 and "was lost" in reply.text, reply.text
    finally:
        victim.stop()

