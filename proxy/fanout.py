"""Several answers in one request (a list of prompts, `n` > 1), sans-I/O: one disaggregated request per
prompt and choice, and their answers merged into the one a single server gives.

A worker would turn such a request into several engine requests that all carry the one
`kv_transfer_params`, so every leg would name the same KV handoff; the proxy gives each answer
a request of its own instead. As vLLM numbers them, the answer of prompt p's choice c has index
p * n + c; choice c is seeded with the request's seed + c (vLLM seeds its n children so); usage
counts each prompt once and every answer's completion.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Sequence

from common.openai_wire import DONE, DONE_EVENT, error_body, sse_event
from proxy.requests import ClientRequest, leg_seed, prefill_alone, prompts
from proxy.sse import SSEDecoder

_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


@dataclass(frozen=True, slots=True)
class Part:
    """One answer of a fanned-out request: its own one-prompt, one-choice request, and its index."""

    request: ClientRequest
    index: int
    counts_prompt: bool  # its prompt's first choice: the one whose prompt tokens the usage counts


def fan_out(request: ClientRequest) -> list[Part] | None:
    """The parts of a request for several answers; None for one answer, or one the prefill worker serves whole."""
    if request.n * request.num_prompts == 1 or prefill_alone(request):
        return None
    seed = leg_seed(request)
    each = [None] if request.endpoint.is_chat else prompts(request.body["prompt"])
    parts = []
    for p, prompt in enumerate(each):
        for c in range(request.n):
            body = {**request.body, "n": 1, **({"prompt": prompt} if prompt is not None else {})}
            part_seed = None if seed is None else seed + c
            if part_seed is not None:
                body["seed"] = part_seed
            parts.append(Part(replace(request, body=body, seed=part_seed, n=1, num_prompts=1), p * request.n + c,
                              c == 0))
    return parts


def summed_usage(parts: Sequence[Part], usages: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The usage of all parts' answers; the first's other fields as it gave them."""
    given = [(part, usage) for part, usage in zip(parts, usages) if usage]
    if not given:
        return None
    prompt = sum(int(usage.get("prompt_tokens", 0)) for part, usage in given if part.counts_prompt)
    completion = sum(int(usage.get("completion_tokens", 0)) for _, usage in given)
    return {**given[0][1], "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def merged_body(response_id: str, parts: Sequence[Part], bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The non-streamed answer of all parts: their choices by index, their usage summed."""
    choices = [{**choice, "index": part.index + int(choice.get("index", 0))}
               for part, body in zip(parts, bodies) for choice in body.get("choices") or []]
    return {**bodies[0], "id": response_id, "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": summed_usage(parts, [body.get("usage") for body in bodies])}


class StreamMerger:
    """The client's SSE events from the parts' streams (each a stitched or relayed answer of its own):
    choices renumbered, the parts' usage chunks and [DONE]s held back, then one usage chunk and one [DONE]."""

    def __init__(self, response_id: str, created: int, parts: Sequence[Part], include_usage: bool) -> None:
        self._ours = {"id": response_id, "created": created}
        self._parts = list(parts)
        self._include_usage = include_usage
        self._decoders = [SSEDecoder() for _ in parts]
        self._usage_chunks: list[dict[str, Any] | None] = [None] * len(parts)
        self.failed = False

    def feed(self, part: int, event: bytes) -> list[bytes]:
        """One event of part `part`'s stream in, the client's events out; after an error event (which ends the
        whole answer: `failed`) nothing more."""
        out: list[bytes] = []
        for data in self._decoders[part].feed(event):
            if self.failed or data == DONE:
                continue
            chunk = _payload(data)
            if "error" in chunk:
                self.failed = True
                out += [sse_event(chunk), DONE_EVENT]
            elif not chunk.get("choices") and chunk.get("usage"):
                self._usage_chunks[part] = chunk
            else:
                base = self._parts[part].index
                choices = [{**c, "index": base + int(c.get("index", 0))} for c in chunk.get("choices") or []]
                out.append(sse_event({**chunk, **self._ours, "choices": choices}))
        return out

    def close(self) -> list[bytes]:
        """Every part's stream ended: the usage chunk if asked for, then [DONE]."""
        chunks = self._usage_chunks
        usage = summed_usage(self._parts, [c.get("usage") if c else None for c in chunks])
        template = next((c for c in chunks if c), None)
        if not self._include_usage or template is None or usage is None:
            return [DONE_EVENT]
        return [sse_event({**template, **self._ours, "usage": usage}), DONE_EVENT]


def _payload(data: str) -> dict[str, Any]:
    """A part's event as a JSON object; one that is not (a relayed worker's bad payload) becomes an error."""
    try:
        chunk = json.loads(data)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        return error_body(502, f"a worker streamed a bad SSE payload {data[:80]!r}", "upstream_error")
    return chunk
