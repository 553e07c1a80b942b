"""Reading one request's timeline from the proxy and both workers, and checking that its phases add up."""
from __future__ import annotations

from typing import Any

import httpx

from common.openai_wire import CHAT_ID_PREFIX, COMPLETION_ID_PREFIX
from common.timeline import merged
from tests.helpers import wait_until


def uid_of(response_id: str) -> str:
    """The proxy's request id (uid) in the id of its answer."""
    for prefix in (CHAT_ID_PREFIX, COMPLETION_ID_PREFIX):
        if response_id.startswith(prefix):
            return response_id[len(prefix):]
    raise AssertionError(f"not an id the proxy makes: {response_id!r}")


def request_timeline(urls: dict[str, str], uid: str) -> dict[str, dict[str, Any]]:
    """source -> record of request `uid`, from `GET /timeline?uid=` of each url (proxy and workers); waits
    until the prefill worker has seen its blocks released (that ends its record)."""
    def read() -> dict[str, dict[str, Any]]:
        answers = [httpx.get(f"{url}/timeline", params={"uid": uid}, timeout=10).json() for url in urls.values()]
        return merged(answers).get(uid, {})

    wait_until(lambda: "released" in read().get("prefill", {}).get("phases", {}), timeout=30,
               what=f"the timeline of {uid} complete")
    return read()


def assert_phases_add_up(records: dict[str, dict[str, Any]], streamed: bool) -> list[tuple[str, float]]:
    """The phases of one concurrent-flow request happened in the order one request's work can happen,
    on one clock, and the spans between them add up to the proxy's whole request; returns the path
    (phase, seconds since received)."""
    assert sorted(records) == ["decode", "prefill", "proxy"], records
    proxy, prefill, decode = (records[s]["phases"] for s in ("proxy", "prefill", "decode"))
    assert all(r["error"] is None for r in records.values()), records
    critical = [("proxy.received", proxy["received"]), ("proxy.prefill_sent", proxy["prefill_sent"]),
                ("prefill.admitted", prefill["admitted"]), ("prefill.published", prefill["published"]),
                ("prefill.push_started", prefill["push_started"]), ("prefill.push_done", prefill["push_done"]),
                ("decode.lookup_answered", decode["lookup_answered"]),
                ("decode.pull_reported", decode["pull_reported"]), ("decode.first_step", decode["first_step"]),
                ("proxy.decode_first", proxy["decode_first"]), ("proxy.done", proxy["done"])]
    decode_side = [("proxy.decode_sent", proxy["decode_sent"]), ("decode.admitted", decode["admitted"]),
                   ("decode.pull_started", decode["pull_started"]),
                   ("decode.lookup_answered", decode["lookup_answered"])]
    for path in (critical, decode_side):
        late = [(a, b) for (a, ta), (b, tb) in zip(path, path[1:]) if tb < ta]
        assert not late, f"phases out of order: {late} in {path}"
    assert prefill["push_done"] <= prefill["released"]
    assert proxy["prefill_sent"] <= proxy["prefill_answered"] <= proxy["done"]
    spans = sum(tb - ta for (_, ta), (_, tb) in zip(critical, critical[1:]))
    assert abs(spans - (proxy["done"] - proxy["received"])) < 1e-6
    if streamed:
        tokens = records["proxy"]["tokens"]
        assert len(tokens) >= 2 and tokens == sorted(tokens)
        assert proxy["prefill_answered"] <= tokens[0] and decode["first_step"] <= tokens[1] <= proxy["done"]
    start = proxy["received"]
    return [(name, t - start) for name, t in critical]
