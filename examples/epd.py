"""Encode, prefill and decode disaggregated (EPD) in one command, checked against one `both` worker.

    python examples/epd.py [--images 1 2 5] [--requests 8] [--concurrency 8] [--kv-transport shm|tcp]

Writes embeddings files (seeded [n, hidden] tensors, .safetensors and .pt in turn) into a temporary
directory, starts an encode, a prefill and a decode worker behind the proxy (`--encode`) and a `both`
worker on the built-in model (stack/epd.py), and sends chat requests with those images as
`image_url` parts to the proxy and to the `both` worker: greedy and seeded sampling, streamed and not.
The proxy has each request's images encoded first; the prefill worker pulls their rows through the
transfer engine. Prints a table per image count and exits 1 if any answer differs, 3 if the stack
could not be started or a request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import httpx
import torch

from stack.epd import start_epd
from stack.serving import StackError, StackOptions

Answer = tuple[int, str, Any]  # HTTP status, text, finish reason (or the error body)


def image_rows(n: int, seed: int, hidden: int) -> torch.Tensor:
    """Seeded rows, small enough that the built-in code model still writes code after an image."""
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05


def write_images(directory: Path, counts: Sequence[int], first_seed: int, hidden: int) -> list[Path]:
    """One file per count, seeded by first_seed + its index: a .safetensors tensor and a .pt dict with aux data
    in turn."""
    import safetensors.torch

    paths = []
    for i, n in enumerate(counts):
        seed, rows = first_seed + i, image_rows(n, first_seed + i, hidden)
        if i % 2:
            path = directory / f"image{seed}.pt"
            torch.save({"embeddings": rows, "image_size": [32, 32 + i]}, path)
        else:
            path = directory / f"image{seed}.safetensors"
            safetensors.torch.save_file({"embeddings": rows}, path)
        paths.append(path)
    return paths


def chat_body(model: str, urls: Sequence[str], i: int, max_tokens: int = 12) -> dict[str, Any]:
    """Request `i`: its images between two texts; odd ones sampled with a seed, every 3rd and 4th of 4 streamed."""
    images = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content = [{"type": "text", "text": f"# request {i}\n"}, *images, {"type": "text", "text": "\ndef main():\n    "}]
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": i % 4 >= 2,
                            "messages": [{"role": "user", "content": content}]}
    return {**body, "temperature": 0.9, "seed": 100 + i} if i % 2 else {**body, "temperature": 0.0}


async def answer(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Answer:
    """(status, text, finish reason or the error body) of one chat request, streamed or not."""
    if not body.get("stream"):
        reply = await client.post(f"{url}/v1/chat/completions", json=body)
        data = reply.json()
        if reply.status_code != 200:
            return reply.status_code, "", data
        return 200, data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"]
    text, finish = "", None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return 500, text, event
                choice = event["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return reply.status_code, text, finish


def answer_all(url: str, bodies: Sequence[dict[str, Any]], concurrency: int, timeout: float = 120) -> list[Answer]:
    """Every body's answer from `url`, `concurrency` in flight."""
    async def run() -> list[Answer]:
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=timeout) as client:
            async def one(body: dict[str, Any]) -> Answer:
                async with limit:
                    return await answer(client, url, body)
            return await asyncio.gather(*(one(b) for b in bodies))
    return asyncio.run(run())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epd.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, nargs="+", default=[1, 2, 5], help="images per request, one round each")
    p.add_argument("--requests", type=int, default=8, help="requests per round (default 8)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--kv-transport", choices=("shm", "tcp"), default="shm",
                   help="KV blocks and embedding rows move over this (default shm)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    return p


def run(args: argparse.Namespace) -> int:
    from worker.model.loader import BUILTIN_MODEL_NAME, builtin_model_path, load_config

    hidden = load_config(builtin_model_path()).hidden_size
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="epd-media-") as media:
        print("starting an encode, a prefill, a decode and a both worker, and the proxy ...", flush=True)
        options = StackOptions(kv_transport=args.kv_transport, startup_timeout_s=args.startup_timeout)
        with start_epd(options, Path(media)) as stack:
            for count in args.images:
                bodies = []
                for i in range(args.requests):
                    paths = write_images(Path(media), [3 + (7 * i + j) % 11 for j in range(count)],
                                         1000 * count + 10 * i, hidden)
                    bodies.append(chat_body(BUILTIN_MODEL_NAME, [p.name for p in paths], i))
                epd = answer_all(stack.url, bodies, args.concurrency)
                both = answer_all(stack.worker_urls["both"], bodies, args.concurrency)
                if any(status != 200 for status, _, _ in epd + both):
                    bad = next(a for a in epd + both if a[0] != 200)
                    raise StackError(f"a request failed: HTTP {bad[0]}: {bad[2]}")
                same = sum(a == b for a, b in zip(epd, both))
                failed |= same != len(bodies)
                rows.append((count, len(bodies), same, epd[0][1]))
    print(f"\n{'images/request':>14} {'requests':>9} {'equal':>6}  first answer (EPD)")
    for count, total, same, text in rows:
        print(f"{count:>14} {total:>9} {same:>6}  {text!r}")
    verdict = "DIFFER from the both worker's" if failed else "equal the both worker's (text and finish reason)"
    print(f"\nEPD answers {verdict}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted; every process was stopped", file=sys.stderr)
        return 130
    except (StackError, httpx.HTTPError) as exc:
        print(f"epd failed: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
