"""A 1P1D stack across two network-namespace hosts, and faults on the cable between them.

    sudo python examples/netns_faults.py --requests 24 --concurrency 8 --delay-ms 20 --loss-pct 1.5

Host a runs the prefill worker; host b the decode worker and the proxy (beside decode, so a
decode leg's error reaches the proxy even while the cable is cut); a `both` worker in this
process's namespace gives the reference answers. Workers use `--kv-transport auto`, which
picks tcp between the hosts.

For a fault campaign:

    from netns_faults import LinkFault, run_link_faults
    from serving_load import LoadSpec
    counts = run_link_faults(LoadSpec(num_prompts=24, input_len=(200, 600), output_len=(4, 12),
                                      max_concurrency=8),
                             [LinkFault("delay+loss", delay_ms=20, loss_pct=1.5),
                              LinkFault("cut", cut=True)])
    for c in counts: print(c.as_dict())

Each LinkFault runs the load once with the fault on (a cut starts once a KV transfer is under
way and lasts until every request has ended), then clears it. Its FaultCounts: `sent`; `ok`
(answers equal to the reference); `clear_error` (an HTTP 5xx with an OpenAI error object, e.g.
kv_transfer_error or the proxy's 502/503); `hung` (no answer within the request deadline);
`wrong` (a 200 that differs, or any other answer); `blocks_leaked` (KV blocks still in use on
both workers once the load ended and the deadline for freeing them passed); `recover_s`
(seconds from clearing the fault until a request is served exactly again; None if it never
is within the deadline); `errors` (count per error type). Raises NetnsUnavailable where
namespaces cannot be made (not root, no iproute2).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import httpx

from common.roles import DEFAULT_KV_PORT
from netns_hosts import Host, TwoHosts
from serving_load import LoadError, LoadSpec, SyntheticRequest, fetch_model, make_requests
from serving_stack import Stack, StackOptions, free_port, proxy_args, started, wait_healthy, worker_args

# Every host has its own ports, so both use the defaults, as separate machines would.
PREFILL_PORT, DECODE_PORT, PROXY_PORT, KV_PORT = 8100, 8200, 8000, DEFAULT_KV_PORT
BLOCKS_USED = re.compile(r"^neuron_di_kv_blocks_used(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)
TRANSFERRING = re.compile(r"^neuron_di_requests_transferring(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


@dataclass(frozen=True, slots=True)
class LinkFault:
    """What the cable does during one run of the load."""

    name: str
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    cut: bool = False


@dataclass(slots=True)
class FaultCounts:
    """How the requests of one LinkFault ended (see the module docstring)."""

    fault: str
    sent: int = 0
    ok: int = 0
    clear_error: int = 0
    hung: int = 0
    wrong: int = 0
    blocks_leaked: int = 0
    recover_s: float | None = None
    errors: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "errors": dict(self.errors)}


@dataclass(slots=True)
class TwoHostStack:
    """The started processes and where this process reaches them."""

    stack: Stack
    hosts: TwoHosts
    proxy_url: str
    reference_url: str
    model: str
    worker_urls: dict[str, str]


def worker_on(host: Host, role: str, port: int, options: StackOptions, extra: Sequence[str] = (),
              kv_port: int | None = None) -> list[str]:
    """A worker listening on every address of `host`, advertising (and moving KV on) its cable address."""
    return [*worker_args(role, port, options, kv_port, host="0.0.0.0"),
            "--kv-host", host.address, "--advertise-host", host.address, *extra]


def start_two_host_di(hosts: TwoHosts, options: StackOptions, extra: Sequence[str] = ()) -> TwoHostStack:
    """Prefill on a, decode and proxy on b, the reference `both` worker here; `extra` goes to both DI workers."""
    a, b = hosts.a, hosts.b
    urls = {"prefill worker": a.mgmt_url(PREFILL_PORT), "decode worker": b.mgmt_url(DECODE_PORT)}
    reference_port = free_port()

    def build(stack: Stack) -> None:
        stack.start("prefill worker", worker_on(a, "prefill", PREFILL_PORT, options, extra, kv_port=KV_PORT),
                    prefix=a.prefix)
        stack.start("decode worker", worker_on(b, "decode", DECODE_PORT, options, extra), prefix=b.prefix)
        stack.start("reference worker", worker_args("both", reference_port, options))
        for url in [*urls.values(), f"http://127.0.0.1:{reference_port}"]:
            wait_healthy(f"{url}/health", stack.processes, options.startup_timeout_s)
        stack.start("proxy", proxy_args(PROXY_PORT, ["--prefill-ip", a.address, "--prefill-port", str(PREFILL_PORT),
                                                     "--decode-ip", b.address, "--decode-port", str(DECODE_PORT),
                                                     "--health-interval", "0.5"], host="0.0.0.0"),
                    prefix=b.prefix)
        wait_healthy(f"{b.mgmt_url(PROXY_PORT)}/ready", stack.processes, options.startup_timeout_s)

    stack = started(build)
    stack.worker_urls = urls
    reference_url = f"http://127.0.0.1:{reference_port}"
    try:
        model = asyncio.run(fetch_model(reference_url))
    except LoadError:
        stack.__exit__(None, None, None)
        raise
    return TwoHostStack(stack, hosts, b.mgmt_url(PROXY_PORT), reference_url, model, urls)


def completion_body(model: str, request: SyntheticRequest) -> dict[str, Any]:
    return {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True}


async def complete(client: httpx.AsyncClient, url: str, model: str, request: SyntheticRequest
                   ) -> tuple[int, dict[str, Any]]:
    """(status, JSON answer) of one non-streamed completion; raises httpx errors and TimeoutError."""
    response = await client.post(f"{url}/v1/completions", json=completion_body(model, request))
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {"raw": response.text[:300]}


def answer_text(answer: dict[str, Any]) -> str | None:
    choices = answer.get("choices")
    return choices[0].get("text") if isinstance(choices, list) and choices else None


async def reference_texts(url: str, model: str, requests: Sequence[SyntheticRequest], timeout_s: float) -> list[str]:
    """The `both` worker's answer to every request (it serves them in one batch)."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        answers = await asyncio.gather(*(complete(client, url, model, r) for r in requests))
    texts = [answer_text(answer) for status, answer in answers if status == 200]
    if len(texts) != len(requests) or any(t is None for t in texts):
        raise RuntimeError(f"the reference worker did not answer every request: {answers[:2]}")
    return texts  # type: ignore[return-value]


def classify(counts: FaultCounts, outcome: tuple[int, dict[str, Any]] | str, expected: str) -> None:
    """Adds one request's outcome (an answer, or "hung") to `counts`."""
    counts.sent += 1
    if outcome == "hung":
        counts.hung += 1
        return
    status, answer = outcome
    error = answer.get("error")
    if status == 200 and answer_text(answer) == expected:
        counts.ok += 1
    elif status >= 500 and isinstance(error, dict) and error.get("message"):
        counts.clear_error += 1
        counts.errors[f"{status} {error.get('type')}"] += 1
    else:
        counts.wrong += 1
        counts.errors[f"{status} {str(answer)[:120]}"] += 1


async def send_all(url: str, model: str, requests: Sequence[SyntheticRequest], spec: LoadSpec
                   ) -> list[tuple[int, dict[str, Any]] | str]:
    """Every request at once (at most spec.max_concurrency in flight); "hung" for those past the deadline."""
    gate = asyncio.Semaphore(spec.max_concurrency or len(requests))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=spec.request_timeout_s, limits=limits) as client:
        async def one(request: SyntheticRequest) -> tuple[int, dict[str, Any]] | str:
            async with gate:
                try:
                    return await asyncio.wait_for(complete(client, url, model, request), spec.request_timeout_s)
                except (asyncio.TimeoutError, httpx.TimeoutException):
                    return "hung"
                except httpx.HTTPError as exc:
                    return 599, {"error": {"message": f"no HTTP answer: {exc!r}", "type": "connection"}}
        return list(await asyncio.gather(*(one(r) for r in requests)))


def metric_sum(url: str, pattern: re.Pattern[str]) -> int:
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    return int(sum(float(v) for v in pattern.findall(text)))


def wait_blocks_free(urls: Sequence[str], timeout_s: float) -> int:
    """KV blocks still in use on the workers, polled until all are 0 or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = sum(metric_sum(url, BLOCKS_USED) for url in urls)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


async def cut_during_transfer(two: TwoHostStack, load: asyncio.Task[Any], timeout_s: float) -> None:
    """Cuts the cable once the decode worker has a KV transfer under way (or the load ended)."""
    decode = two.worker_urls["decode worker"]
    deadline = time.monotonic() + timeout_s
    while not load.done() and time.monotonic() < deadline:
        if await asyncio.to_thread(metric_sum, decode, TRANSFERRING) > 0:
            break
        await asyncio.sleep(0.01)
    two.hosts.link.set(up=False)


async def run_loaded(two: TwoHostStack, fault: LinkFault, requests: Sequence[SyntheticRequest], spec: LoadSpec
                     ) -> list[tuple[int, dict[str, Any]] | str]:
    two.hosts.link.set(delay_ms=fault.delay_ms, loss_pct=fault.loss_pct, up=True)
    load = asyncio.ensure_future(send_all(two.proxy_url, two.model, requests, spec))
    if fault.cut:
        await cut_during_transfer(two, load, spec.request_timeout_s)
    return await load


def time_to_recover(two: TwoHostStack, request: SyntheticRequest, expected: str, timeout_s: float) -> float | None:
    """Seconds from now until `request` is answered exactly through the proxy; None past `timeout_s`."""
    start = time.monotonic()

    async def exact() -> bool:
        async with httpx.AsyncClient(timeout=10.0) as client:
            try:
                status, answer = await complete(client, two.proxy_url, two.model, request)
            except httpx.HTTPError:
                return False
        return status == 200 and answer_text(answer) == expected

    while time.monotonic() - start < timeout_s:
        if asyncio.run(exact()):
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def run_fault(two: TwoHostStack, fault: LinkFault, spec: LoadSpec, free_timeout_s: float = 30.0) -> FaultCounts:
    """One run of the load under `fault` (see the module docstring)."""
    requests = make_requests(spec)
    expected = asyncio.run(reference_texts(two.reference_url, two.model, requests, spec.request_timeout_s))
    counts = FaultCounts(fault.name)
    try:
        outcomes = asyncio.run(run_loaded(two, fault, requests, spec))
        for outcome, text in zip(outcomes, expected):
            classify(counts, outcome, text)
        counts.blocks_leaked = wait_blocks_free(list(two.worker_urls.values()), free_timeout_s)
    finally:
        two.hosts.link.clear()
    counts.recover_s = time_to_recover(two, requests[0], expected[0], spec.request_timeout_s)
    return counts


def run_link_faults(spec: LoadSpec, faults: Sequence[LinkFault], pull_timeout_s: float = 5.0,
                    options: StackOptions = StackOptions(kv_transport="auto")) -> list[FaultCounts]:
    """Builds the two hosts and the stack, runs `spec` under each fault in turn, tears everything down."""
    extra = ["--kv-pull-timeout", f"{pull_timeout_s:g}", "--kv-abort-timeout", f"{2 * pull_timeout_s:g}"]
    with TwoHosts() as hosts:
        two = start_two_host_di(hosts, options, extra)
        with two.stack:
            return [run_fault(two, fault, spec) for fault in faults]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24, help="requests per fault (default 24)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default 8)")
    parser.add_argument("--input-len", type=int, nargs=2, default=(50, 1200), metavar=("MIN", "MAX"))
    parser.add_argument("--delay-ms", type=float, default=20.0, help="delay of the delay+loss fault (default 20)")
    parser.add_argument("--loss-pct", type=float, default=1.5, help="loss of the delay+loss fault (default 1.5)")
    parser.add_argument("--pull-timeout", type=float, default=10.0, help="the workers' --kv-pull-timeout")
    args = parser.parse_args(argv)
    spec = LoadSpec(num_prompts=args.requests, input_len=tuple(args.input_len), output_len=(4, 16),
                    max_concurrency=args.concurrency, request_timeout_s=4 * args.pull_timeout)
    faults = [LinkFault("delay+loss", delay_ms=args.delay_ms, loss_pct=args.loss_pct), LinkFault("cut", cut=True)]
    for counts in run_link_faults(spec, faults, args.pull_timeout):
        print(json.dumps(counts.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
