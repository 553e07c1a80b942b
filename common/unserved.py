"""vLLM's request parameters our worker does not implement, each with the values that ask for nothing.

Our worker refuses any other value (a 400 naming the parameter) rather than silently ignore it, and the
proxy refuses the same before it sends any leg when its workers are ours (a vLLM server serves some of
them). Parameters that do not change what is generated (user, metadata, store, cache_salt, ...) and keys
vLLM does not know either are accepted and ignored, as vLLM does.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

_EMPTY = ("", [], {})
UNSERVED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "use_beam_search": (False,), "length_penalty": (1,),
    "bad_words": _EMPTY, "logits_processors": _EMPTY, "allowed_token_ids": (), "logprob_token_ids": _EMPTY,
    "suffix": _EMPTY, "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "return_token_ids": (False,), "truncate_prompt_tokens": (), "prompt_embeds": (), "priority": (0,),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "vllm_xargs": _EMPTY,
    "tools": _EMPTY, "tool_choice": ("none", "auto"),
    "functions": _EMPTY, "function_call": ("none", "auto"), "modalities": (["text"],), "audio": (),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": _EMPTY, "documents": _EMPTY,
}


def refusal(body: Mapping[str, Any], key: str, neutral: tuple[Any, ...], param: str | None = None) -> str | None:
    """Why body[key] is refused (None if it is null or one of the `neutral` values; true is not 1 here)."""
    value = body.get(key)
    if value is None or any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in neutral):
        return None
    accepted = " or ".join(json.dumps(ok) for ok in (*neutral, None))
    return f"`{param or key}` is not supported by this server (accepted: {accepted})"


def first_unserved(body: Mapping[str, Any], is_chat: bool) -> tuple[str, str] | None:
    """The first parameter of a completion or chat body our worker does not serve, with why; None if none.
    Completions add BOS to a text prompt; a chat template writes its own special tokens."""
    for key, neutral in {**UNSERVED, "add_special_tokens": (not is_chat,)}.items():
        why = refusal(body, key, neutral)
        if why is not None:
            return key, why
    return None
