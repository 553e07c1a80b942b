"""A client request's prompt as the token ids the worker will see, counted by the proxy itself.

Servers encode a completion prompt differently: our worker always starts it with the model's BOS, while
`vllm serve` adds what its tokenizer's post-processor adds (a BOS for most models, none for some), so the
prompt's ids, and the blocks they fill, differ by server (`encoding_of`). A chat prompt is the template's
text, with the BOS the template writes, on every server."""
from __future__ import annotations

from typing import Any, Iterable

from common.errors import ChatTemplateError
from common.tokenizer import Tokenizer
from common.worker_record import OUR_SERVER, VLLM_SERVER, WorkerRecord
from proxy.errors import BadRequest
from proxy.requests import ClientRequest


def encoding_of(worker: WorkerRecord) -> str:
    """How `worker` encodes prompts: OUR_SERVER, or VLLM_SERVER (also a static worker showing no record)."""
    return OUR_SERVER if worker.server == OUR_SERVER else VLLM_SERVER


def prompt_ids_by_encoding(request: ClientRequest, tokenizer: Tokenizer,
                           workers: Iterable[WorkerRecord]) -> dict[str, list[int]] | None:
    """The prompt's token ids as each server among `workers` encodes them (keys: `encoding_of`); None for a
    prompt the proxy does not count."""
    out: dict[str, list[int]] = {}
    for encoding in sorted({encoding_of(worker) for worker in workers}):
        ids = prompt_token_ids(request, tokenizer, encoding)
        if ids is None:
            return None
        out[encoding] = ids
    return out


def prompt_token_ids(request: ClientRequest, tokenizer: Tokenizer, encoding: str = OUR_SERVER) -> list[int] | None:
    """The prompt's token ids, encoded as a worker of `encoding` (see `encoding_of`) encodes them; None for a
    prompt the proxy does not count (a batch of several prompts, or chat content other than text), which the
    worker judges itself."""
    if request.endpoint.is_chat:
        messages = [_text_message(m) for m in request.body["messages"]]
        if any(m is None for m in messages):
            return None
        try:
            text = tokenizer.apply_chat_template(messages)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), "messages") from exc
        return tokenizer.encode(text, add_bos=False)  # the template writes the BOS it wants
    prompt = request.body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if encoding != OUR_SERVER:
            return tokenizer.encode_with_specials(prompt)
        return tokenizer.encode(prompt, add_bos=True)
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


def _text_message(message: dict[str, Any]) -> dict[str, str] | None:
    """A message with its content as one string (text parts joined), as the worker reads it; None if it
    has other content."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    return {"role": message["role"], "content": content} if isinstance(content, str) else None
