"""Reads the per-request timelines of a DI stack and prints them: where each request's time went.

    python examples/timeline.py --url proxy=http://127.0.0.1:8000 --url prefill=http://127.0.0.1:8100 \\
        --url decode=http://127.0.0.1:8200                      # the last 10 requests, then a summary
    python examples/timeline.py --url ... --uid UID             # one request, every phase
    python examples/timeline.py --url ... --last 200 --json timelines.json

Each `--url NAME=URL` is a process answering `GET /timeline` (common/timeline.py): the proxy, our
workers (their HTTP API), and `vllm serve` workers through NeuronConnector's status server (the
`status_port` of `kv_connector_extra_config`). Phases are merged by request id (the proxy's uid) and
printed in time order, as milliseconds since the proxy received the request. Per request the
summary shows its largest gap between two streamed tokens and which phases fall inside it, then
the median and p99 of every span over the requests read. Exit status 0, 1 if a url cannot be read.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import httpx

from common.timeline import SPANS, merged

Records = dict[str, dict[str, Any]]   # source -> one request's record there


def fetch(urls: dict[str, str], uid: str | None, last: int | None, timeout: float = 10.0) -> dict[str, Records]:
    """uid -> source -> record, read from every url."""
    params = {"uid": uid} if uid else ({"n": str(last)} if last is not None else {})
    answers = []
    for name, url in urls.items():
        reply = httpx.get(f"{url.rstrip('/')}/timeline", params=params, timeout=timeout)
        reply.raise_for_status()
        answers.append(reply.json())
    return merged(answers)


def phases(records: Records) -> list[tuple[str, float]]:
    """Every phase of one request as (source.phase, time), in time order."""
    found = [(f"{source}.{phase}", t) for source, record in records.items() for phase, t in record["phases"].items()]
    return sorted(found, key=lambda item: item[1])


def origin(records: Records) -> float:
    """The request's time zero: when the proxy received it (else its earliest phase)."""
    proxy = records.get("proxy", {}).get("phases", {})
    return proxy.get("received", min(t for _, t in phases(records)))


def largest_gap(records: Records) -> tuple[float, int] | None:
    """(seconds, index of the token after it) of the request's largest gap between two streamed tokens."""
    tokens = records.get("proxy", {}).get("tokens", [])
    if len(tokens) < 2:
        return None
    gaps = [b - a for a, b in zip(tokens, tokens[1:])]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return gaps[worst], worst + 1


def format_request(uid: str, records: Records) -> str:
    zero = origin(records)
    lines = [f"request {uid}"]
    lines += [f"  {1e3 * (t - zero):9.1f} ms  {name}" for name, t in phases(records)]
    tokens = records.get("proxy", {}).get("tokens", [])
    if tokens:
        lines.append(f"  tokens at the proxy: {len(tokens)}, first at {1e3 * (tokens[0] - zero):.1f} ms, "
                     f"last at {1e3 * (tokens[-1] - zero):.1f} ms")
    gap = largest_gap(records)
    if gap is not None:
        seconds, index = gap
        start, end = tokens[index - 1], tokens[index]
        inside = [name for name, t in phases(records) if start < t <= end]
        lines.append(f"  largest gap {1e3 * seconds:.1f} ms, before token {index + 1}"
                     + (f", spanning {', '.join(inside)}" if inside else ""))
    errors = [f"{source}: {r['error']}" for source, r in records.items() if r.get("error")]
    lines += [f"  error at {e}" for e in errors]
    return "\n".join(lines)


def span_table(requests: dict[str, Records]) -> str:
    """Median and p99 (ms) of each span over the requests that have both of its phases."""
    rows = ["span                                  n    p50 ms    p99 ms"]
    for source, spans in SPANS.items():
        for name, (start, end) in spans.items():
            values = sorted(r[source]["phases"][end] - r[source]["phases"][start] for r in requests.values()
                            if source in r and start in r[source]["phases"] and end in r[source]["phases"])
            if values:
                rows.append(f"{source + '.' + name:34s} {len(values):5d} {1e3 * _quantile(values, 0.5):9.1f} "
                            f"{1e3 * _quantile(values, 0.99):9.1f}")
    gaps = sorted(g[0] for r in requests.values() if (g := largest_gap(r)) is not None)
    if gaps:
        rows.append(f"{'proxy.largest_gap':34s} {len(gaps):5d} {1e3 * _quantile(gaps, 0.5):9.1f} "
                    f"{1e3 * _quantile(gaps, 0.99):9.1f}")
    return "\n".join(rows)


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="timeline.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", required=True, metavar="NAME=URL",
                   help="a process answering GET /timeline (repeat: proxy, prefill, decode, ...)")
    p.add_argument("--uid", help="one request's id (the proxy's; its answer's id without cmpl- or chatcmpl-)")
    p.add_argument("--last", type=int, default=10, help="the last N requests of each process (default 10)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write uid -> source -> record as JSON")
    args = p.parse_args(argv)
    try:
        args.urls = dict(item.split("=", 1) for item in args.url)
    except ValueError:
        p.error("--url takes NAME=URL")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        requests = fetch(args.urls, args.uid, args.last)
    except httpx.HTTPError as exc:
        print(f"timeline.py: cannot read a timeline: {exc}", file=sys.stderr)
        return 1
    ordered = sorted(requests.items(), key=lambda item: origin(item[1]))
    for uid, records in ordered:
        print(format_request(uid, records) + "\n")
    if len(ordered) > 1:
        print(span_table(requests))
    if args.json is not None:
        args.json.write_text(json.dumps(requests, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
