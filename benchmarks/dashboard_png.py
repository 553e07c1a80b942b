"""The Grafana dashboard (deploy/grafana/neuron-di.json) rendered with matplotlib from a real run: a 1P1D stack of
our worker under streamed load, scraped by a real Prometheus, every panel's queries over the run.

    python -m benchmarks.dashboard_png --out docs/images/dashboard.png [--seconds 90] [--quick] [--json PATH]

Prints each panel's last values; `--json` writes them with the run's settings.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import time
from pathlib import Path
from typing import Any

import httpx

from stack.prometheus import DASHBOARD, PrometheusServer
from stack.serving import StackOptions, start_di

_WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch".split()


async def _client(url: str, until: float, rng: random.Random, answered: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < until:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 120)))
            body = {"model": "neuron-di-builtin", "prompt": prompt, "max_tokens": rng.randint(4, 24),
                    "temperature": 0.0, "stream": rng.random() < 0.8}
            if body["stream"]:
                async with client.stream("POST", "/v1/completions", json=body) as reply:
                    async for _ in reply.aiter_bytes():
                        pass
                    answered.append(reply.status_code)
            else:
                answered.append((await client.post("/v1/completions", json=body)).status_code)
            await asyncio.sleep(rng.uniform(0.0, 0.5))


async def _load(url: str, seconds: float, clients: int) -> list[int]:
    answered: list[int] = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(_client(url, until, random.Random(i), answered) for i in range(clients)))
    return answered


def _series(prometheus: PrometheusServer, target: dict[str, str], start: float, end: float,
            step: float) -> list[tuple[str, list, list]]:
    out = []
    for result in prometheus.query_range(target["expr"], start, end, step):
        points = [(float(t) - start, float(v)) for t, v in result["values"] if not math.isnan(float(v))]
        if points:
            out.append((_label(target.get("legendFormat", ""), result["metric"]), *map(list, zip(*points))))
    return out


def _label(legend: str, metric: dict[str, str]) -> str:
    """Grafana's legend: `{{name}}` replaced by the series' label `name`."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), legend).strip()[:48] or "value"


def render(prometheus: PrometheusServer, start: float, end: float, out: Path) -> dict[str, Any]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(15, 2.7 * rows), squeeze=False)
    step = max(1.0, (end - start) / 120)
    last: dict[str, Any] = {}
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            for label, xs, ys in _series(prometheus, target, start, end, step):
                ax.plot(xs, ys, linewidth=1.2, label=label)
                last[f"{panel['title']} | {label}"] = round(ys[-1], 6)
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("neuron-di: where the time went (1P1D, our worker, seconds since the run began)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images/dashboard.png"))
    parser.add_argument("--seconds", type=float, default=90.0, help="how long the load runs")
    parser.add_argument("--clients", type=int, default=3, help="concurrent clients")
    parser.add_argument("--quick", action="store_true", help="20 s of load")
    parser.add_argument("--json", type=Path, help="write the panels' last values here")
    args = parser.parse_args()
    seconds = 20.0 if args.quick else args.seconds
    with start_di(StackOptions(cores=(0, 1))) as stack:
        jobs = {"neuron-di-proxy": [stack.url.removeprefix("http://")],
                "neuron-di-prefill": [stack.worker_urls["prefill worker"].removeprefix("http://")],
                "neuron-di-decode": [stack.worker_urls["decode worker"].removeprefix("http://")]}
        prometheus = PrometheusServer(jobs, interval_s=1.0)
        try:
            start = time.time()
            answered = asyncio.run(_load(stack.url, seconds, args.clients))
            time.sleep(3.0)  # the last scrape after the load
            last = render(prometheus, start, time.time(), args.out)
        finally:
            prometheus.stop()
    print(f"{len(answered)} requests ({answered.count(200)} answered 200) in {seconds:g} s; {args.out} written")
    for name, value in last.items():
        print(f"  {name:70} {value:g}")
    if args.json:
        args.json.write_text(json.dumps({"seconds": seconds, "clients": args.clients, "requests": len(answered),
                                         "ok": answered.count(200), "last": last}, indent=1))


if __name__ == "__main__":
    main()
