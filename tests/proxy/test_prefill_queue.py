"""The global prefill queue with real processes: a nats-server with JetStream, two prefill workers pulling
from it, a decode worker, and proxies putting prefill legs on it. Every answer is what one `both` worker
gives; jobs that break the contract or whose client left are never run; NATS going away is a clear 503 and
its return resumes serving; a prefill worker killed holding jobs has them redelivered, nothing lost."""
from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Awaitable, Callable, Iterator, TypeVar

import httpx
import msgpack
import nats
import pytest
from nats.js import JetStreamContext

from common.prefill_job import JOB_SUBJECT, REFUSED, REPLY_HEADER, STREAM_NAME, JobReply, PrefillJob, attempt_id
from stack.etcd import EtcdServer
from stack.nats import NatsServer
from tests.helpers import wait_until
from tests.proxy.conftest import Server, start_proxy
from tests.proxy.flow_clients import paths
from tests.proxy.test_conditional_exact import MODEL, answers
from tests.worker_process import WorkerProcess, start_workers, stop_together

# Each proxy's flags beside the workers and the queue: the strategies the queue serves (decode_first: the
# decode worker puts the prefill leg on the queue), and conditional disaggregation (long prompts through the
# queue, short ones served by the decode worker alone).
PROXIES = {"concurrent": ["--disaggregation-strategy", "concurrent"],
           "prefill_first": ["--disaggregation-strategy", "prefill_first"],
           "decode_first": ["--disaggregation-strategy", "decode_first"],
           "conditional": ["--conditional-disaggregation", "--tokenizer", "builtin", "--max-local-prefill-tokens", "48"]}
T = TypeVar("T")


class QueueStack:
    def __init__(self) -> None:
        self.nats = NatsServer()
        self.prefills: list[WorkerProcess] = []
        self.workers: list[WorkerProcess] = []
        self.proxies: dict[str, Server] = {}
        try:
            queue = ["--prefill-queue", self.nats.url, "--prefill-queue-max-jobs", "2"]
            # A pull from a prefill worker killed mid-job ends (its blocks freed) at the pull timeout.
            kinds = [("prefill", "shm", queue), ("prefill", "shm", queue),
                     ("decode", "shm", ["--kv-pull-timeout", "5", "--prefill-queue", self.nats.url]),
                     ("both", "shm", [])]
            with ThreadPoolExecutor(len(kinds)) as pool:  # started side by side: each loads its model
                started = [pool.submit(WorkerProcess, *kind) for kind in kinds]
                wait(started)
            self.workers = [future.result() for future in started if future.exception() is None]
            for future in started:
                if future.exception() is not None:
                    raise future.exception()  # type: ignore[misc]
            *self.prefills, self.decode, self.both = self.workers
            prefill_args = [f"--prefill=127.0.0.1:{w.port}:{w.kv_port}" for w in self.prefills]
            for name, flags in PROXIES.items():
                self.proxies[name] = start_proxy([*prefill_args, "--decode", f"127.0.0.1:{self.decode.port}",
                                                  "--prefill-queue", self.nats.url, *flags])
        except BaseException:
            self.stop()
            raise

    def stream_messages(self) -> int:
        return self._jetstream(lambda js: js.stream_info(STREAM_NAME)).state.messages

    def jobs_published(self) -> int:
        return self._jetstream(lambda js: js.stream_info(STREAM_NAME)).state.last_seq

    def retaken(self, worker: WorkerProcess) -> int:
        """Jobs `worker` ran that another worker had taken first (run under an id common.prefill_job.attempt_id
        gives a later taker)."""
        recent = httpx.get(f"{worker.url}/timeline", params={"n": 1000}, timeout=10).json()["requests"]
        return sum(record["uid"] == attempt_id(record["uid"].split("-take")[0], 2) for record in recent)

    def given_again(self, worker: WorkerProcess) -> int:
        """Jobs another worker had taken first that `worker` took: run again (`retaken`), or dropped because their
        requester was done with them (the first taker died after their KV left it, before it acked them)."""
        return self.retaken(worker) + worker.proc.output().count("dropped: its requester is gone")

    def _jetstream(self, ask: Callable[[JetStreamContext], Awaitable[T]]) -> T:
        async def read() -> T:
            nc = await nats.connect(self.nats.url)
            try:
                return await ask(nc.jetstream())
            finally:
                await nc.close()
        return asyncio.run(read())

    def prompt_tokens(self) -> int:
        """Prompt tokens the prefill workers admitted so far."""
        total = 0
        for worker in self.prefills:
            text = httpx.get(f"{worker.url}/metrics", timeout=10).text
            total += sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                         if line.startswith("neuron_di_prompt_tokens_total"))
        return total

    def settled(self) -> None:
        """Blocks back to 0 on every live worker, the stream empty, and no prefill worker holding a job."""
        for worker in self.workers:
            if worker.proc.proc.poll() is None:
                worker.wait_blocks_free()
        wait_until(lambda: self.stream_messages() == 0, timeout=15)
        for worker in self.prefills:
            if worker.proc.proc.poll() is None:
                wait_until(lambda: worker.metric("neuron_di_prefill_jobs_held") == 0, timeout=15)

    def stop(self) -> None:
        stop_together(*(proxy.process for proxy in self.proxies.values()), *self.workers)
        self.nats.stop()


@pytest.fixture(scope="module")
def stack() -> Iterator[QueueStack]:
    stack = QueueStack()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.mark.parametrize("name", PROXIES)
def test_queued_requests_answer_as_one_worker(stack: QueueStack, name: str) -> None:
    proxy = stack.proxies[name]
    before = paths(proxy)
    published = stack.jobs_published()
    via_queue = asyncio.run(answers(proxy.url, 16, 16))
    assert via_queue == asyncio.run(answers(stack.both.url, 16, 16))
    jobs = stack.jobs_published() - published   # one per request whose prefill went through the queue
    if name == "conditional":
        after = paths(proxy)
        assert all(after[path] > before.get(path, 0) for path in ("local", "remote")), (before, after)
        assert jobs == after["remote"] - before.get("remote", 0), (jobs, before, after)
    else:
        assert jobs == 16
    stack.settled()
    assert "proxy_prefill_queue_depth 0.0" in httpx.get(f"{proxy.url}/metrics", timeout=10).text


def publish(url: str, data: bytes, reply: str | None, listen: bool) -> list[JobReply]:
    """Puts `data` on the job stream with `reply` in its header; the replies heard there in 3 s if `listen`."""
    async def run() -> list[JobReply]:
        nc = await nats.connect(url)
        heard: list[JobReply] = []
        try:
            if listen and reply:
                await nc.subscribe(reply, cb=functools.partial(_heard, heard))
            await nc.jetstream().publish(JOB_SUBJECT, data, stream=STREAM_NAME,
                                         headers={REPLY_HEADER: reply} if reply else None)
            deadline = time.monotonic() + 3
            while listen and not heard and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return heard
        finally:
            await nc.close()
    return asyncio.run(run())


async def _heard(heard: list[JobReply], msg: nats.aio.msg.Msg) -> None:
    heard.append(JobReply.from_bytes(msg.data))


@pytest.mark.parametrize("data", [b"\xc1 not msgpack", msgpack.packb({"v": 99}), msgpack.packb({"v": 1, "id": "x"})])
def test_a_malformed_job_is_refused_to_its_requester_and_never_retried(stack: QueueStack, data: bytes) -> None:
    heard = publish(stack.nats.url, data, "test.malformed.reply", listen=True)
    assert [reply.kind for reply in heard] == [REFUSED], heard
    assert heard[0].message.startswith("malformed prefill job: ")
    stack.settled()


def test_a_job_whose_client_left_is_dropped_never_run(stack: QueueStack) -> None:
    before = stack.prompt_tokens()
    body = {"model": MODEL, "prompt": "nobody waits for this", "max_tokens": 1,
            "kv_transfer_params": {"role": "prefill", "request_id": "gone-1"}}
    for job in (PrefillJob("gone-1", "/v1/completions", body, "test.nobody.listens"),
                PrefillJob("gone-2", "/v1/completions", body, "test.nobody.either", deadline=time.time() - 1)):
        publish(stack.nats.url, job.to_bytes(), job.reply, listen=False)
    stack.settled()
    assert stack.prompt_tokens() == before


def test_nats_down_is_a_clear_503_and_serving_resumes_when_it_is_back(stack: QueueStack) -> None:
    """Through the proxy (concurrent) and through the decode worker (decode_first)."""
    proxies = [stack.proxies["concurrent"], stack.proxies["decode_first"]]
    body = {"model": MODEL, "prompt": "the queue is back", "max_tokens": 4, "temperature": 0}
    stack.nats.kill()
    for proxy in proxies:
        reply = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=10)
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        assert "prefill queue" in message and "NATS" in message and stack.nats.url in message, message
    stack.nats.restart()
    back = time.monotonic()
    for proxy in proxies:
        wait_until(lambda: httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=10).status_code == 200,
                   timeout=30, interval=0.1)
        print(f"serving again {time.monotonic() - back:.2f} s after nats-server came back")
    stack.settled()


def test_a_worker_that_changes_role_changes_its_side_of_the_queue(etcd_server: EtcdServer) -> None:
    """A prefill worker that becomes a decode worker stops pulling jobs, and a decode worker that becomes a
    prefill worker starts (POST /role, as the planner's flip connector does): every answer is still one
    `both` worker's, and the jobs ran on the new prefill worker."""
    queue = NatsServer()
    flags = ["--etcd", etcd_server.endpoint, "--etcd-ttl", "3", "--prefill-queue", queue.url]
    workers: list[WorkerProcess] = []
    proxy = None
    try:
        workers = start_workers(("prefill", "shm", flags), ("decode", "shm", flags), ("decode", "shm", flags),
                                ("both", "shm", []))
        was_prefill, _, was_decode, both = workers
        changes = ((was_prefill, "decode"), (was_decode, "prefill"))
        for worker, role in changes:
            assert httpx.post(f"{worker.url}/role", json={"role": role}, timeout=10).status_code == 202
        for worker, role in changes:
            wait_until(functools.partial(_serves_as, worker, role), timeout=60, what=f"{worker.url} serving {role}")
        proxy = start_proxy(["--etcd", etcd_server.endpoint, "--prefill-queue", queue.url])
        assert asyncio.run(answers(proxy.url, 16, 8)) == asyncio.run(answers(both.url, 16, 8))
        held = "neuron_di_prefill_jobs_held"   # exported by a worker that pulls jobs, and only by one
        assert held not in httpx.get(f"{was_prefill.url}/metrics", timeout=10).text
        assert was_decode.metric(held) == 0 and was_decode.metric("neuron_di_prompt_tokens_total") > 0
        for worker in workers:
            worker.wait_blocks_free()
    finally:
        stop_together(proxy.process if proxy is not None else None, *workers)
        queue.stop()


def _serves_as(worker: WorkerProcess, role: str) -> bool:
    health = httpx.get(f"{worker.url}/health", timeout=5).json()
    last = health.get("last_role_change") or {}
    return "changing_role" not in health and last.get("to") == role and last.get("ok") is True


def test_a_prefill_worker_killed_holding_jobs_loses_nothing(stack: QueueStack) -> None:
    """Last: it kills a prefill worker while 72 requests (new prompts) keep both busy, 32 at concurrency 8 whose
    proxy puts their prefill legs on the queue (concurrent), 24 at 6 whose decode worker does (decode_first) and
    16 at 4 whose decode legs start after the prefill's answer (prefill_first); it is killed as soon as it holds
    a job it has not acked (its gauge neuron_di_prefill_jobs_held)."""
    proxies = [stack.proxies[name] for name in ("concurrent", "decode_first", "prefill_first")]
    victim, survivor = stack.prefills
    loads = [(proxies[0], 32, 8), (proxies[1], 24, 6), (proxies[2], 16, 4)]

    async def all_of(url_of: Callable[[Server], str]) -> list[list[str]]:
        return list(await asyncio.gather(*(answers(url_of(proxy), n, c) for proxy, n, c in loads)))

    async def run() -> list[list[str]]:
        load = asyncio.ensure_future(all_of(lambda proxy: proxy.url))
        while not load.done() and await asyncio.to_thread(victim.metric, "neuron_di_prefill_jobs_held") == 0:
            await asyncio.sleep(0.005)
        # Seen once in CI (1 in 5 runs here): the load ended with no job seen on the victim; its log says whether
        # its puller came back after the previous test's nats-server restart.
        assert not load.done(), f"the victim took no job; its log ends:\n{victim.proc.tail()}"
        victim.proc.kill()
        return await load

    given_before = stack.given_again(survivor)
    via_queue = asyncio.run(run())
    assert via_queue == asyncio.run(all_of(lambda _: stack.both.url))
    # Every job the victim held comes back ACK_WAIT_S after its death, and leaves the stream once acked.
    wait_until(lambda: stack.stream_messages() == 0, timeout=15)
    assert stack.given_again(survivor) > given_before, "no job of the killed worker was given to the survivor"
    print("decode_first retakes:", stack.decode.proc.output().count("its prefill job was taken again"),
          "survivor retakes:", stack.retaken(survivor))
    stack.workers.remove(victim)
    survivor.wait_blocks_free()
    stack.decode.wait_blocks_free()
    victim.stop()
