"""Dynamic 2P2D over etcd across two network-namespace hosts: the same ports on both hosts (a
prefill worker on 8100 and a decode worker on 0.0.0.0:8200 on each), etcd and the proxy on host
a, every worker registering its own host's address. Answers equal a single `both` worker's.

The proxy's round-robin advances its prefill and decode turns together, so it would pair the
workers of one host only; every third request of the load is prefill-only (max_tokens 1), which
shifts the prefill turn alone, so each prefill worker serves both decode workers at the same
time, its own host's over shm and the other's over tcp.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import pytest

from faults.load import Load, LoadSize, Reference, Tally
from faults.two_hosts import DECODE_PORT, KV_PORT, PREFILL_PORT, PROXY_PORT, worker_on
from faults.netns_hosts import NetnsUnavailable, TwoHosts, check_available
from benchmarks.serving_load import LoadSpec, make_requests
from stack.serving import Stack, StackOptions, proxy_args, started, wait_healthy
from stack.etcd import EtcdServer
from stack.serving import wait_healthy
from tests.helpers import wait_until
from stack.worker_metrics import wait_blocks_free

OPTIONS = StackOptions(kv_transport="auto")
LOAD = LoadSpec(num_prompts=24, input_len=(20, 400), output_len=(4, 10), seed=5, request_timeout_s=120.0)


def start_xpyd(hosts: TwoHosts, etcd: str, explicit_ids: bool) -> Stack:
    """The workers, and the proxy on a."""
    def build(stack: Stack) -> None:
        for host in hosts.hosts:
            for role, port in (("prefill", PREFILL_PORT), ("decode", DECODE_PORT)):
                ids = ["--engine-id", f"{role}-{host.name}"] if explicit_ids else []
                stack.start(f"{role} worker {host.name}", worker_on(
                    host, role, port, OPTIONS, ["--etcd", etcd, *ids], kv_port=KV_PORT if role == "prefill" else None),
                    prefix=host.prefix)
                stack.worker_urls[f"{role} worker {host.name}"] = host.mgmt_url(port)
        for url in stack.worker_urls.values():
            wait_healthy(f"{url}/health", stack.processes, OPTIONS.startup_timeout_s)
        stack.start("proxy", proxy_args(PROXY_PORT, ["--etcd", etcd, "--health-interval", "0.5"], host="0.0.0.0"),
                    prefix=hosts.a.prefix)
        stack.url = hosts.a.mgmt_url(PROXY_PORT)
        wait_healthy(f"{stack.url}/ready", stack.processes, OPTIONS.startup_timeout_s)

    return started(build)


def all_discovered(proxy_url: str) -> bool:
    workers = httpx.get(f"{proxy_url}/health", timeout=5.0).json()["workers"]
    return workers["prefill"]["healthy"] == 2 and workers["decode"]["healthy"] == 2


def serve(stack: Stack, reference: Reference) -> Tally:
    """LOAD sent at once, not streamed, every third request prefill-only."""
    requests = [replace(r, output_len=1) if i % 3 == 2 else r for i, r in enumerate(make_requests(LOAD))]
    load = Load(stack.url, requests, LoadSize(len(requests), len(requests), LOAD.request_timeout_s), stream=False)
    tally = Tally()
    asyncio.run(load.run())
    asyncio.run(tally.add_load(load, reference))
    return tally


@pytest.mark.parametrize("explicit_ids", [pytest.param(True, id="engine-ids-given", marks=pytest.mark.slow),
                                          pytest.param(False, id="default-engine-ids", marks=pytest.mark.slow)])
def test_2p2d_over_etcd_across_two_hosts_serves_exactly(explicit_ids: bool) -> None:
    try:
        check_available()
    except NetnsUnavailable as exc:
        pytest.skip(f"no network-namespace hosts here: {exc}")
    with TwoHosts() as hosts:
        etcd = EtcdServer(hosts=(hosts.a.address, hosts.a.mgmt_address), prefix=hosts.a.prefix)
        try:
            with start_xpyd(hosts, etcd.endpoint, explicit_ids) as stack, Reference(OPTIONS) as reference:
                wait_until(lambda: all_discovered(stack.url), timeout=60, what="the proxy to see 2P2D healthy")
                tally = serve(stack, reference)
                assert (tally.ok, tally.sent) == (LOAD.num_prompts, LOAD.num_prompts), tally
                for host in hosts.hosts:
                    log = next(p for p in stack.processes if p.name == f"prefill worker {host.name}").tail(100_000)
                    assert "KV blocks go over shm" in log and "KV blocks go over tcp" in log
                assert not any(wait_blocks_free(stack.worker_urls, timeout_s=30).values())
        finally:
            etcd.stop()
