"""A chat over KV-aware routing: each turn goes to the prefill worker that holds the chat so far.

    python examples/multiturn_chat.py [--turns 4] [--max-tokens 32] [--no-write-back] [--model PATH]

Starts two prefill workers and a decode worker that publish their KV cache events, and a proxy with
`--routing kv`, on free ports on 127.0.0.1. It then has a chat of a few turns through the proxy with the
official `openai` client, each turn's prompt being the chat so far, and prints, per turn, which prefill worker
served it and how many of the prompt's tokens it computed: the rest it held already. With write-back of every
answer (the default here: `--kv-write-back all` on every worker; the workers' own default, `chats`, starts with
the second answer, once the chat holds one) the decode worker gives each answer's KV back to that prefill
worker, so a turn computes little more than its new message; with `--no-write-back` (`--kv-write-back off`) it
computes the last answer again too. Every process is stopped on the way out, also on Ctrl-C or an error. Exit status 1: the
stack could not be started or a request failed.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import openai

from stack.serving import Stack, StackError, StackOptions
from stack.worker_metrics import metric
from stack.xpyd import start_xpyd

OPENING = "# A small stack, in Python\nclass Stack:\n    def __init__(self):\n        "
FOLLOW_UPS = ("\n\n    def push(self, item):\n        ", "\n\n    def pop(self):\n        ",
              "\n\n    def peek(self):\n        ", "\n\n    def __len__(self):\n        ")
SAMPLING = {"temperature": 0.8, "seed": 1, "extra_body": {"top_k": 40}}   # the same text on every run
COMPUTED = "neuron_di_prefill_step_tokens_total"
WRITTEN_BACK = "neuron_di_kv_write_back_cached_blocks_total"


@dataclass(frozen=True)
class Turn:
    """One turn: its prompt's length and which prefill worker computed how many of its tokens."""

    prompt_tokens: int
    worker: str
    computed: int


def prefill_workers(stack: Stack) -> dict[str, str]:
    return {name: url for name, url in stack.worker_urls.items() if name.startswith("prefill")}


def counters(stack: Stack, name: str) -> dict[str, float]:
    return {worker: metric(url, name, 0.0) for worker, url in prefill_workers(stack).items()}


def wait_for_write_back(stack: Stack, before: dict[str, float], timeout_s: float = 10.0) -> None:
    """Until a prefill worker cached more written-back blocks than in `before` (the answer's KV came back)."""
    deadline = time.monotonic() + timeout_s
    while sum(counters(stack, WRITTEN_BACK).values()) <= sum(before.values()):
        if time.monotonic() > deadline:
            print("  (no answer KV came back within the deadline: the next turn computes it)")
            return
        time.sleep(0.05)


def chat(stack: Stack, client: openai.OpenAI, model: str, turns: int, max_tokens: int,
         write_back: bool) -> list[Turn]:
    """The chat, turn by turn; what each turn's prefill worker computed."""
    prompt, asked, reports = OPENING, OPENING, []
    for turn in range(turns):
        computed, written = counters(stack, COMPUTED), counters(stack, WRITTEN_BACK)
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **SAMPLING)
        after = counters(stack, COMPUTED)
        worker = max(after, key=lambda name: after[name] - computed[name])
        reports.append(Turn(answer.usage.prompt_tokens, worker, int(after[worker] - computed[worker])))
        print(f"\n=== turn {turn + 1}: {answer.usage.prompt_tokens} prompt tokens; {worker} computed "
              f"{reports[-1].computed} of them and held the rest")
        print(("..." if turn else "") + asked + answer.choices[0].text)
        if write_back:
            wait_for_write_back(stack, written)
        asked = FOLLOW_UPS[turn % len(FOLLOW_UPS)]
        prompt += answer.choices[0].text + asked
    return reports


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="multiturn_chat.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    p.add_argument("--turns", type=int, default=4, help="turns of the chat (default 4)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    p.add_argument("--no-write-back", dest="write_back", action="store_false",
                   help="workers with --kv-write-back off: each turn computes the last answer again")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for each process to be ready")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.turns < 1 or args.max_tokens < 1:
        print("--turns and --max-tokens must be at least 1", file=sys.stderr)
        return 2
    options = StackOptions(model=args.model, kv_transport="shm", startup_timeout_s=args.startup_timeout,
                           worker_extra=("--kv-write-back", "all" if args.write_back else "off"),
                           proxy_extra=("--routing", "kv", "--tokenizer", args.model or "builtin"))
    print("starting two prefill workers, a decode worker and a KV-routed proxy ...", flush=True)
    try:
        with start_xpyd(options, 2, 1) as stack:
            print(f"proxy {stack.url} -> prefill {', '.join(prefill_workers(stack).values())}, "
                  f"decode {stack.worker_urls['decode worker 0']} (routing by KV cache events"
                  f"{', answers written back' if args.write_back else ''})", flush=True)
            client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=300, max_retries=0)
            model = client.models.list().data[0].id
            reports = chat(stack, client, model, args.turns, args.max_tokens, args.write_back)
        held = sum(r.prompt_tokens - r.computed for r in reports[1:])
        print(f"\nturns 2..{len(reports)}: {held} of {sum(r.prompt_tokens for r in reports[1:])} prompt tokens were "
              f"held by the prefill worker that served them; stopped every process")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; every process was stopped", file=sys.stderr)
        return 130
    except (StackError, openai.OpenAIError) as exc:
        print(f"multiturn_chat failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
