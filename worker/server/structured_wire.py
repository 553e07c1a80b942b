"""A request's structured output constraint (`response_format`, `structured_outputs`) as an llguidance
grammar, sans I/O.

    response_format  {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema"}}
    structured_outputs  exactly one of {"json": schema}, {"regex": str}, {"choice": [str, ...]}
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

import llguidance

from worker.errors import invalid

_KINDS = ("json", "regex", "choice")


def parse_grammar(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(grammar, the body field it came from), or None when the output is not constrained."""
    response_format = body.get("response_format")
    outputs = body.get("structured_outputs")
    if response_format is not None and outputs is not None and response_format != {"type": "text"}:
        raise invalid("give either `response_format` or `structured_outputs`, not both", "response_format")
    if outputs is not None:
        return _checked(_structured_outputs(outputs), "structured_outputs"), "structured_outputs"
    grammar = None if response_format is None else _response_format(response_format)
    return None if grammar is None else (_checked(grammar, "response_format"), "response_format")


def _checked(grammar: str, param: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid(f"the structured output constraint cannot be compiled: {error.strip()}", param)
    return grammar


def _response_format(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("When response_format type is 'json_schema', the 'json_schema' field must be provided "
                          "(an object whose `schema` is a JSON schema).", "response_format")
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    raise invalid("`response_format.type` must be 'text', 'json_object' or 'json_schema'", "response_format")


def _structured_outputs(value: Any) -> str:
    if not isinstance(value, dict):
        raise invalid("`structured_outputs` must be an object", "structured_outputs")
    unknown = [k for k, v in value.items() if v is not None and v is not False and k not in _KINDS]
    if unknown:
        raise invalid(f"`structured_outputs.{unknown[0]}` is not supported by this server (supported: "
                      f"{', '.join(_KINDS)})", "structured_outputs")
    given = [k for k in _KINDS if value.get(k) is not None]
    if len(given) != 1:
        raise invalid("You can only use one kind of constraints for structured outputs ('json', 'regex' or "
                      "'choice').", "structured_outputs")
    kind, spec = given[0], value[given[0]]
    if kind == "json":
        try:
            schema = json.loads(spec) if isinstance(spec, str) else spec
        except ValueError:
            schema = None
        if not isinstance(schema, dict):
            raise invalid("`structured_outputs.json` must be a JSON schema", "structured_outputs")
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if kind == "regex" and isinstance(spec, str):
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice" and isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec):
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec))
    raise invalid(f"`structured_outputs.{kind}` must be a {'string' if kind == 'regex' else 'list of strings'}",
                  "structured_outputs")
