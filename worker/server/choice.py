"""One choice of a response, sans I/O: its engine request's outputs in, what the choice says out.

A response holds n choices per prompt (completions: prompt-major, index = prompt * n + choice).
`echo` puts the prompt (completions; chat: the last message if the assistant wrote it) before
the first output, with the prompt's logprobs before the output's; `hide_output` (echo with
max_tokens 0) shows the prompt alone while the token the engine ran still counts in usage, as
vLLM counts it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.engine.request import RequestOutput
from worker.server.protocol import GenerateRequest
from worker.server.logprobs_wire import Position, chat_logprobs, completion_logprobs, positions, prompt_logprobs
from worker.server.responses import ChoiceBody, Kind
from worker.server.token_text import TokenStrings


@dataclass(frozen=True)
class ChoiceSpec:
    """How one choice shows its request's outputs."""

    index: int
    kind: Kind
    prompt_ids: list[int]
    echo_text: str | None = None       # shown before the output (echo)
    echo_prompt_logprobs: bool = False  # completions echo: the prompt's tokens lead the logprobs
    hide_output: bool = False
    num_logprobs: int | None = None     # per output token; None: no logprobs
    tokens_as_ids: bool = False         # logprobs name tokens "token_id:<id>"
    token_ids: bool = False             # each body carries its new token ids


def choice_spec(req: GenerateRequest, index: int, prompt_ids: list[int], prompt_index: int,
                strings: TokenStrings) -> ChoiceSpec:
    """What choice `index` of `req` (of its prompt `prompt_index`) shows."""
    echo_text = None
    if req.echo and req.kind == "completion":
        text = req.prompts[prompt_index]
        echo_text = text if isinstance(text, str) else strings.decode(text)   # special tokens shown, as vLLM
    elif req.echo and req.messages[-1]["role"] == "assistant":
        echo_text = req.messages[-1]["content"]
    return ChoiceSpec(index, req.kind, prompt_ids, echo_text, echo_prompt_logprobs=req.echo,
                      hide_output=req.hide_output, num_logprobs=req.num_logprobs, tokens_as_ids=req.tokens_as_ids,
                      token_ids=req.token_ids)


@dataclass
class Choice:
    spec: ChoiceSpec
    strings: TokenStrings
    num_tokens: int = 0
    finish_reason: str | None = None
    prompt_entries: list[Position] | None = None
    _output_ids: list[int] = field(default_factory=list)
    _text_offset: int = 0
    _echoed: bool = False

    def step(self, out: RequestOutput) -> ChoiceBody:
        """What the choice says for one output of its request."""
        spec = self.spec
        self.num_tokens += len(out.new_token_ids)
        if out.prompt_logprobs is not None:
            first = Position(spec.prompt_ids[0], None, (), raw_text=True)   # vLLM reads the tokens after it alone
            self.prompt_entries = [first] + positions(spec.prompt_ids[1:], out.prompt_logprobs[1:])
        text = "" if spec.hide_output else out.text_delta
        items: list[Position] = []
        if not spec.hide_output and spec.num_logprobs is not None:
            items = positions(out.new_token_ids, out.logprobs or [None] * len(out.new_token_ids), self._output_ids)
        prompt_ids: list[int] | None = None
        if spec.echo_text is not None and not self._echoed:
            self._echoed = True
            text = spec.echo_text + text
            if spec.kind == "completion":
                prompt_ids = spec.prompt_ids
                if spec.echo_prompt_logprobs and spec.num_logprobs is not None:
                    items = (self.prompt_entries or []) + items
        self._output_ids.extend(out.new_token_ids)
        if out.finished:
            self.finish_reason = out.finish_reason
        return ChoiceBody(spec.index, text, self._logprobs(items), out.finish_reason if out.finished else None,
                          out.stop_reason if out.finished else None, prompt_token_ids=prompt_ids,
                          token_ids=list(out.new_token_ids) if spec.token_ids else None)

    def resumes(self, resumed: tuple[int, ...]) -> None:
        """The answer began on another worker with `resumed`: they count as this choice's tokens."""
        self.num_tokens = len(resumed)
        self._output_ids.extend(resumed)

    def _logprobs(self, items: list[Position]) -> dict[str, Any] | None:
        k = self.spec.num_logprobs
        if k is None:
            return None
        strings = self.strings.as_ids() if self.spec.tokens_as_ids else self.strings
        if self.spec.kind == "chat":
            return chat_logprobs(items, strings, k)
        body = completion_logprobs(items, strings, k, self._text_offset)
        if body["tokens"]:
            self._text_offset = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def prompt_logprobs_body(self) -> list[Any] | None:
        return None if self.prompt_entries is None else prompt_logprobs(self.prompt_entries, self.strings)


def merged(bodies: list[ChoiceBody], prompt_logprobs_body: list[Any] | None = None) -> ChoiceBody:
    """One choice's chunks as the one body of a whole answer."""
    last = bodies[-1]
    logprobs = None
    if last.logprobs is not None:
        logprobs = {key: [v for b in bodies if b.logprobs for v in b.logprobs[key]] for key in last.logprobs}
    token_ids = None if last.token_ids is None else [t for b in bodies for t in b.token_ids or ()]
    return ChoiceBody(last.index, "".join(b.text for b in bodies), logprobs, last.finish_reason, last.stop_reason,
                      prompt_logprobs=prompt_logprobs_body, token_ids=token_ids)
