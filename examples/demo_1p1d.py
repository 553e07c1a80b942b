"""The main job: a 1P1D stack on the built-in model, asked a few questions with the openai client.

    python examples/demo_1p1d.py [--model PATH] [--kv-transport auto|shm|tcp] [--max-tokens 48]

Starts a prefill worker, a decode worker and the proxy on free ports on 127.0.0.1 (so nothing
already using 8000 gets in the way), sends completions and chat requests through the proxy with
the official `openai` client, one of each streamed, prints them, and stops every process on the
way out, also on Ctrl-C or an error. Exit status 1: the stack could not be started or a request
failed.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import openai

from stack.serving import StackError, StackOptions, start_di
from worker.model.loader import BUILTIN_MODEL_NOTE

# The built-in model is a tiny byte-level model trained on Python's stdlib: it continues code, and answers
# chat turns with docstring-like sentences.
PROMPTS = ("import os\nimport sys\n\n\ndef main():\n    ", "class Stack:\n    def __init__(self):\n        ")
CHAT = "def add(a, b):"
# Seeded sampling: varied text that is the same on every run (greedy decoding of a small model loops).
SAMPLING = {"temperature": 0.8, "seed": 1, "extra_body": {"top_k": 40}}


def completions(client: openai.OpenAI, model: str, max_tokens: int) -> None:
    for prompt in PROMPTS:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **SAMPLING)
        print(f"\n=== completion ({answer.usage.prompt_tokens} prompt + "
              f"{answer.usage.completion_tokens} completion tokens)\n{prompt}{answer.choices[0].text}")
    print(f"\n=== streamed completion\n{PROMPTS[0]}", end="", flush=True)
    for chunk in client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=max_tokens, stream=True,
                                           **SAMPLING):
        print(chunk.choices[0].text, end="", flush=True)
    print()


def chats(client: openai.OpenAI, model: str, max_tokens: int) -> None:
    messages = [{"role": "user", "content": CHAT}]
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **SAMPLING)
    print(f"\n=== chat: {CHAT!r}\n{answer.choices[0].message.content}")
    print(f"\n=== streamed chat: {CHAT!r}")
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                stream=True, **SAMPLING):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo_1p1d.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    p.add_argument("--kv-transport", default="auto", choices=("auto", "shm", "tcp"),
                   help="how the KV cache moves from prefill to decode (default auto)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default 48)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for each process to be ready")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = StackOptions(model=args.model, kv_transport=args.kv_transport, startup_timeout_s=args.startup_timeout)
    print("starting a prefill worker, a decode worker and the proxy ...", flush=True)
    try:
        with start_di(options) as stack:
            print(f"proxy {stack.url} -> prefill {stack.worker_urls['prefill worker']}, "
                  f"decode {stack.worker_urls['decode worker']} (kv transport {args.kv_transport})")
            client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=300, max_retries=0)
            model = client.models.list().data[0].id
            print(f"serving {model}: each request is prefilled on one worker and decoded on the other")
            if args.model is None:
                print(f"({BUILTIN_MODEL_NOTE})")
            completions(client, model, args.max_tokens)
            chats(client, model, args.max_tokens)
        print("\nstopped the proxy and both workers")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; every process was stopped", file=sys.stderr)
        return 130
    except (StackError, openai.OpenAIError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
