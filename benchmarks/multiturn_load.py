"""A multi-turn chat load: conversations whose every turn resends the whole conversation so far.

Turn 1's prompt is a system text every conversation shares plus the conversation's own opening;
turn k's prompt is turn k-1's prompt + its answer + new user text, as a chat client sends it.
Prompts are text (the answer comes back as text), built from words of an ASCII vocabulary, so
the same seed gives the same conversations (and, greedy, the same answers) on every stack. A
conversation runs its turns one after the other. Closed loop (the default): `max_concurrency`
conversations run at once, each starting when another ends, so a faster server is sent more. Open
loop (`session_rate` set): conversations start at Poisson times (serving_load.arrival_offsets, the
same for the same seed, stretched to the rate asked for) whatever the server does, and each turn
follows the last answer after `think_time_s`, so every server is offered the same chats at the same
times. `api`: "completions" sends each turn's prompt as text ("user:" / "assistant:" lines); "chat" sends
the same texts as /v1/chat/completions messages (the shared system text as a system message, each answer
as an assistant message), which the server renders with its chat template.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx
from tqdm import tqdm

from benchmarks.serving_load import arrival_offsets, progress, stream_body
from benchmarks.serving_metrics import RequestResult

APIS = ("completions", "chat")
USER, ANSWER = "\nuser: ", "\nassistant:"   # a text prompt's turn labels
WORDS = ("def", "return", "self", "value", "list", "for", "in", "if", "else", "print", "class", "import",
         "data", "item", "index", "count", "result", "while", "true", "none", "the", "and", "with", "user")


@dataclass(frozen=True, slots=True)
class MultiturnSpec:
    """N conversations of T turns; text lengths in characters, answers in tokens (inclusive ranges)."""

    num_conversations: int
    num_turns: int
    system_chars: int = 400
    opening_chars: tuple[int, int] = (200, 400)
    user_chars: tuple[int, int] = (40, 120)
    output_len: tuple[int, int] = (16, 48)
    max_concurrency: int = 4
    seed: int = 0
    request_timeout_s: float = 300.0
    num_system_prompts: int = 1           # conversation i opens with system text i % num_system_prompts
    session_rate: float | None = None     # conversations started per second (open loop); None: closed loop
    think_time_s: float = 0.0             # pause between an answer and the next turn
    api: str = "completions"              # APIS: text prompts, or chat messages

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.session_rate is not None and not self.session_rate > 0:
            raise ValueError("session_rate must be positive (None: closed loop)")
        if self.think_time_s < 0:
            raise ValueError("think_time_s must be at least 0")
        if min(self.num_conversations, self.num_turns, self.max_concurrency, self.num_system_prompts) < 1:
            raise ValueError("conversations, turns, max_concurrency and system prompts must be at least 1")
        for name in ("opening_chars", "user_chars", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}: need 1 <= min <= max, got {low}..{high}")
        if self.system_chars < 0:
            raise ValueError("system_chars must be at least 0")


@dataclass(frozen=True, slots=True)
class Conversation:
    """What the user says: the opening (after the shared system text), then one text per later turn."""

    opening: str
    user_turns: tuple[str, ...]
    output_lens: tuple[int, ...]          # answer length of every turn


def _text(rng: random.Random, num_chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < num_chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def make_conversations(spec: MultiturnSpec) -> tuple[str, list[Conversation]]:
    """The shared system text and every conversation, the same for the same seed; with several system
    prompts the shared text is "" and each conversation's opening starts with its own system prompt."""
    rng = random.Random(spec.seed)
    systems = [f"system {k}: " * (spec.num_system_prompts > 1) + _text(rng, spec.system_chars) + "\n"
               if spec.system_chars else "" for k in range(spec.num_system_prompts)]
    system = systems[0] if spec.num_system_prompts == 1 else ""
    conversations = []
    for i in range(spec.num_conversations):
        own = "" if spec.num_system_prompts == 1 else systems[i % spec.num_system_prompts]
        opening = own + f"conversation {i}: " + _text(rng, rng.randint(*spec.opening_chars))
        users = tuple(USER + _text(rng, rng.randint(*spec.user_chars)) + ANSWER for _ in range(spec.num_turns - 1))
        lens = tuple(rng.randint(*spec.output_len) for _ in range(spec.num_turns))
        conversations.append(Conversation(opening + ANSWER, users, lens))
    return system, conversations


def turn_body(model: str, prompt: str | list[dict[str, str]], output_len: int) -> dict[str, Any]:
    """A text prompt's completion, or the chat completion of `prompt`'s messages."""
    return {"model": model, "messages" if isinstance(prompt, list) else "prompt": prompt, "max_tokens": output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


def chat_messages(system: str, conversation: Conversation, answers: list[str]) -> list[dict[str, str]]:
    """The messages of the turn after `answers`: the texts of the text prompt without its turn labels."""
    said = [conversation.opening.removesuffix(ANSWER)]
    said += [text.removeprefix(USER).removesuffix(ANSWER) for text in conversation.user_turns[:len(answers)]]
    messages = [{"role": "system", "content": system}] if system else []
    for turn, text in enumerate(said):
        messages.append({"role": "user", "content": text})
        if turn < len(answers):
            messages.append({"role": "assistant", "content": answers[turn]})
    return messages


def start_offsets(spec: MultiturnSpec) -> list[float] | None:
    """When each conversation starts, in seconds from the run's start (open loop); None: closed loop.

    Poisson gaps, stretched so that the last conversation starts at (n - 1) / rate: a few dozen
    exponential gaps alone put the run's own rate up to about 20% off the one asked for."""
    if spec.session_rate is None:
        return None
    offsets = arrival_offsets(spec.num_conversations, spec.session_rate, spec.seed)
    if offsets[-1] <= 0:
        return offsets
    stretch = (spec.num_conversations - 1) / spec.session_rate / offsets[-1]
    return [offset * stretch for offset in offsets]


async def run_conversation(client: httpx.AsyncClient, url: str, model: str, system: str,
                           conversation: Conversation, timeout_s: float, think_time_s: float = 0.0,
                           chat: bool = False, bar: tqdm | None = None) -> list[RequestResult]:
    """Every turn in order (each counted on `bar`); a failed turn ends the conversation (the next prompt would lack
    its answer)."""
    prompt, results = system + conversation.opening, []
    for turn, output_len in enumerate(conversation.output_lens):
        if turn:
            await asyncio.sleep(think_time_s)
            prompt += results[-1].text + conversation.user_turns[turn - 1]
        sent = chat_messages(system, conversation, [r.text for r in results]) if chat else prompt
        result = await stream_body(client, url, turn_body(model, sent, output_len),
                                   RequestResult(len(prompt), output_len), timeout_s, bar)
        results.append(result)
        if not result.ok:
            break
    return results


async def run_multiturn(base_url: str, model: str, spec: MultiturnSpec) -> tuple[list[RequestResult], float]:
    """Runs every conversation (closed loop: `max_concurrency` at once; open loop: each at its start offset);
    the turns' results and the run's duration."""
    url = base_url.rstrip("/") + ("/v1/chat/completions" if spec.api == "chat" else "/v1/completions")
    system, conversations = make_conversations(spec)
    offsets = start_offsets(spec)
    gate = asyncio.Semaphore(spec.max_concurrency if offsets is None else spec.num_conversations)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    with progress(sum(len(c.output_lens) for c in conversations), "turns") as bar:
        async with httpx.AsyncClient(timeout=httpx.Timeout(spec.request_timeout_s), limits=limits) as client:
            async def one(conversation: Conversation, offset: float) -> list[RequestResult]:
                await asyncio.sleep(max(offset - (time.perf_counter() - t0), 0.0))
                async with gate:
                    return await run_conversation(client, url, model, system, conversation, spec.request_timeout_s,
                                                  spec.think_time_s, spec.api == "chat", bar)

            t0 = time.perf_counter()
            per_conversation: Sequence[list[RequestResult]] = await asyncio.gather(
                *(one(c, offset) for c, offset in zip(conversations, offsets or [0.0] * len(conversations))))
    results = [r for turns in per_conversation for r in turns]
    return results, time.perf_counter() - t0
