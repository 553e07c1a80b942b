"""Reads the live figures: the proxy's /metrics (TTFT, ITL, the prefill queue where one exists) and every
serving worker's (load, KV use, measured speed), each against its previous read.

No guesses: a page that cannot be read, a counter that went back (a restart) or a previous read older
than `max_age_s` make the interval's figures None, with why. A worker read for the first time counts
from its second read on.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Sequence

import httpx

from planner.figures import Figures, RoleFigures
from planner.fleet import Member
from planner.scrape import Scrape, delta, parse, percentile

TTFT = "proxy_time_to_first_token_seconds"
ITL = "proxy_inter_token_latency_seconds"
PROMPT_TOKENS = "neuron_di_prompt_tokens_total"
QUEUE_DEPTH = "neuron_di_prefill_queue_depth"          # exported by a proxy with a prefill queue
QUEUE_WAIT = "neuron_di_prefill_queue_wait_seconds"


class Observer:
    """Keeps the reads of each page over the last `window_s` seconds; `figures()` gives what happened since
    the oldest of them (at least the previous read), so that a short interval's noise is smoothed, and the
    demand of the last interval alone and, if `sample()` read the pages within it, of the time since."""

    def __init__(self, proxy_url: str, percentile_q: float, max_age_s: float, timeout_s: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None, window_s: float = 0.0) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self.q = percentile_q
        self.max_age_s = max_age_s
        self.window_s = window_s
        self._client = httpx.AsyncClient(timeout=timeout_s, transport=transport)
        self._history: list[dict[str, Scrape]] = []   # the reads within the window, oldest first
        self._sampled: dict[str, Scrape] = {}          # the reads sample() made since the last figures()
        self.in_flight: dict[str, float] = {}   # worker URL -> requests running and waiting, at the last read

    async def close(self) -> None:
        await self._client.aclose()

    async def sample(self, members: Sequence[Member]) -> None:
        """Reads the pages of the proxy and the serving `members` within an interval: the next figures'
        tail is the demand since (a page not read here has none)."""
        urls, reads = await self._read_all(members)
        self._sampled = {url: read for url, read in zip(urls, reads) if isinstance(read, Scrape)}

    async def figures(self, members: Sequence[Member]) -> tuple[Figures | None, str]:
        """The figures of the serving `members` since the last call, or (None, why not)."""
        urls, reads = await self._read_all(members)
        previous = self._history[-1] if self._history else {}
        sampled, self._sampled = self._sampled, {}
        before = self._remember({url: read for url, read in zip(urls, reads) if isinstance(read, Scrape)})
        self.in_flight = {url: sum(read.value(name) or 0.0 for name in ("neuron_di_requests_running",
                                                                        "neuron_di_requests_waiting"))
                          for url, read in zip(urls[1:], reads[1:]) if isinstance(read, Scrape)}
        failed = [f"{url}: {read}" for url, read in zip(urls, reads) if isinstance(read, str)]
        if failed:
            return None, "metrics missing (" + "; ".join(failed) + ")"
        now = dict(zip(urls, reads))
        if self.proxy_url not in before:
            return None, "first read of the proxy's metrics"
        members = [m for m in members if m.url in before]   # one read first: a worker new to the fleet counts next time
        urls = [self.proxy_url] + [m.url for m in members]
        stale = [url for url in urls if now[url].at - before[url].at > self.max_age_s]   # type: ignore[union-attr]
        if stale:
            return None, f"previous read older than {self.max_age_s:g} s: {', '.join(stale)}"
        proxy_now, proxy_before = now[self.proxy_url], before[self.proxy_url]
        assert isinstance(proxy_now, Scrape)
        window = proxy_now.at - proxy_before.at
        roles = {}
        for role in ("prefill", "decode"):
            pairs = [(now[m.url], before[m.url]) for m in members if m.role == role]
            figures = role_figures(pairs, window)   # type: ignore[arg-type]
            if figures is None:
                return None, f"a {role} worker's counters went back (it restarted)"
            roles[role] = figures
        # The last interval alone, and its tail since sample(): a shift shows there before the window's mean shows it.
        latest_p, latest_d = recent_rates(members, now, previous, self.proxy_url)   # type: ignore[arg-type]
        tail_p, tail_d = recent_rates(members, now, sampled, self.proxy_url)   # type: ignore[arg-type]
        roles["prefill"] = replace(roles["prefill"], latest_prompt_tokens_per_s=latest_p,
                                   tail_prompt_tokens_per_s=tail_p)
        roles["decode"] = replace(roles["decode"], latest_requested_tokens_per_s=latest_d,
                                  tail_requested_tokens_per_s=tail_d)
        ttft, samples = percentile(proxy_now, proxy_before, TTFT, self.q)
        itl, _ = percentile(proxy_now, proxy_before, ITL, self.q)
        depth = proxy_now.value(QUEUE_DEPTH)
        wait, _ = percentile(proxy_now, proxy_before, QUEUE_WAIT, self.q)
        return Figures(window, samples, ttft, itl, roles["prefill"], roles["decode"],
                       None if depth is None else int(depth), wait), "ok"

    def _remember(self, current: dict[str, Scrape]) -> dict[str, Scrape]:
        """Each page's oldest read within the window (at least its previous one); keeps `current` for later."""
        history, at = self._history, time.monotonic()
        kept = [read for read in history[:-1] if read and at - min(s.at for s in read.values()) <= self.window_s]
        kept += history[-1:]
        before: dict[str, Scrape] = {}
        for read in reversed(kept):   # newest first: an older read of the same page overrides
            before.update(read)
        self._history = kept + [current]
        return before

    async def _read_all(self, members: Sequence[Member]) -> tuple[list[str], list[Scrape | str]]:
        """The URLs of the proxy and `members`, and each page's read (a Scrape, or what went wrong), at once."""
        urls = [self.proxy_url] + [m.url for m in members]
        return urls, list(await asyncio.gather(*(self._read(url) for url in urls)))

    async def _read(self, url: str) -> Scrape | str:
        """The page's Scrape, or what went wrong."""
        try:
            reply = await self._client.get(f"{url}/metrics")
            if reply.status_code != 200:
                return f"HTTP {reply.status_code}"
            return parse(reply.text, time.monotonic())
        except (httpx.HTTPError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"


def recent_rates(members: Sequence[Member], now: dict[str, Scrape], since: dict[str, Scrape],
                 proxy_url: str) -> tuple[float | None, float | None]:
    """(Prompt tokens per second the prefill members received, output tokens per second the requests the
    decode members received ask for) from the reads `since` to `now`, timed by the proxy's reads (None
    without a read of the proxy since)."""
    before = since.get(proxy_url)
    if before is None or now[proxy_url].at <= before.at:
        return None, None
    seconds = now[proxy_url].at - before.at
    pairs = {role: [(now[m.url], since[m.url]) for m in members if m.role == role and m.url in since]
             for role in ("prefill", "decode")}
    grown = [delta(after, read, PROMPT_TOKENS) for after, read in pairs["prefill"]]
    return sum(g for g in grown if g is not None) / seconds, requested_rate(pairs["decode"], seconds)


def role_figures(pairs: Sequence[tuple[Scrape, Scrape]], window: float) -> RoleFigures | None:
    """One role's figures from each worker's (now, before) reads; None if a counter went back."""
    sums: dict[str, float] = {}
    for name in (PROMPT_TOKENS, "neuron_di_generation_tokens_total",
                 "neuron_di_engine_busy_seconds_total", "neuron_di_prefill_step_tokens_total",
                 "neuron_di_prefill_step_seconds_total", "neuron_di_decode_steps_total",
                 "neuron_di_decode_step_seconds_total", "neuron_di_decode_step_seqs_total"):
        grown = [delta(now, before, name) for now, before in pairs]
        if any(g is None for g in grown):
            return None
        sums[name] = sum(g for g in grown if g is not None)
    gauge = {name: [now.value(name) or 0.0 for now, _ in pairs]
             for name in ("neuron_di_requests_running", "neuron_di_requests_waiting",
                          "neuron_di_kv_blocks_used", "neuron_di_kv_blocks_total")}
    kv = [used / total for used, total in zip(gauge["neuron_di_kv_blocks_used"], gauge["neuron_di_kv_blocks_total"])
          if total > 0]
    steps = sums["neuron_di_decode_steps_total"]
    prefill_s = sums["neuron_di_prefill_step_seconds_total"]
    workers = len(pairs)
    return RoleFigures(
        workers=workers,
        prompt_tokens_per_s=sums[PROMPT_TOKENS] / window,
        generated_tokens_per_s=sums["neuron_di_generation_tokens_total"] / window,
        requested_tokens_per_s=requested_rate(pairs, window),
        busy_fraction=sums["neuron_di_engine_busy_seconds_total"] / window / workers if workers else 0.0,
        running=sum(gauge["neuron_di_requests_running"]),
        waiting=sum(gauge["neuron_di_requests_waiting"]),
        kv_used_fraction=max(kv, default=0.0),
        prefill_tokens_per_busy_s=sums["neuron_di_prefill_step_tokens_total"] / prefill_s if prefill_s > 0.05 else None,
        decode_step_s=sums["neuron_di_decode_step_seconds_total"] / steps if steps else None,
        decode_batch=sums["neuron_di_decode_step_seqs_total"] / steps if steps else None)


def requested_rate(pairs: Sequence[tuple[Scrape, Scrape]], window: float) -> float | None:
    """Output tokens per second the requests received by the workers of the (now, before) `pairs` ask for,
    times the share of what they asked for that the workers' finished requests produced (1 before any
    finished; a request stopped early by EOS or a stop string asks for more than it takes); None where a
    worker does not count them."""
    grown = [delta(now, before, "neuron_di_requested_tokens_total") for now, before in pairs]
    if any(g is None for g in grown):
        return None
    asked, produced = (sum(now.value(name) or 0.0 for now, _ in pairs) for name in
                       ("neuron_di_finished_requested_tokens_total", "neuron_di_finished_generated_tokens_total"))
    share = min(produced / asked, 1.0) if asked > 0 else 1.0
    return sum(g for g in grown if g is not None) * share / window
