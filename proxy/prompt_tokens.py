"""A client request's prompt as the token ids the worker will see, counted by the proxy itself."""
from __future__ import annotations

from typing import Any

from common.errors import ChatTemplateError
from common.tokenizer import Tokenizer
from proxy.errors import BadRequest
from proxy.requests import ClientRequest


def prompt_token_ids(request: ClientRequest, tokenizer: Tokenizer) -> list[int] | None:
    """The prompt's token ids, encoded as the worker encodes them; None for a prompt the proxy does not
    count (a batch of several prompts, or chat content other than text), which the worker judges itself."""
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
