"""Tokenizer loading, chat templates and incremental detokenization with stop strings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import ChatTemplateError
from common.tokenizer import Tokenizer
from worker import ModelLoadError
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.model.loader import builtin_model_path
from worker.model.model_config import ModelConfig
from worker.model.tokenizer import load_tokenizer


def load(path: Path) -> Tokenizer:
    return load_tokenizer(path, ModelConfig.from_dir(path))


def stream(tok: Tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], bool]:
    detok = IncrementalDetokenizer(tok, stop)
    deltas = []
    for n in range(1, len(ids) + 1):
        deltas.append(detok.step(ids[:n], finished=n == len(ids)))
        if detok.stopped:
            break
    return deltas, detok.stopped


def test_byte_tokens_round_trip_with_bos(tiny_llama: Path) -> None:
    tok = load(tiny_llama)
    text = "héllo wörld → ∑ 🐍\n\tdef f(): pass"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256 and ids[1:] == list(text.encode())
    assert tok.encode(text, add_bos=False) == list(text.encode())
    assert tok.decode(ids) == text and tok.eos_token_id == 257


def test_partial_utf8_is_held_back_until_complete(tiny_llama: Path) -> None:
    tok = load(tiny_llama)
    ids = list("a🐍b".encode())
    deltas, _ = stream(tok, ids, [])
    assert deltas == ["a", "", "", "", "🐍", "b"]


def test_stop_string_across_tokens_is_cut_and_never_leaks(tiny_llama: Path) -> None:
    tok = load(tiny_llama)
    deltas, stopped = stream(tok, list(b"x = 1\nEND of it"), ["END", "\n\n"])
    assert stopped and "".join(deltas) == "x = 1\n"
    assert all("E" not in d for d in deltas)
    # A held-back prefix that turns out not to be a stop string is released.
    deltas, stopped = stream(tok, list(b"ENable"), ["END"])
    assert not stopped and "".join(deltas) == "ENable" and deltas[:2] == ["", ""]


def test_chat_template_from_tokenizer_config(tiny_llama: Path, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert load(tiny_llama).apply_chat_template(messages) == "system: be brief\nuser: hi\nassistant: "
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((tiny_llama / name).read_bytes())
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}"
                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|bos|>"}, "eos_token": "<|eos|>", "chat_template": template}))
    tok = load(tmp_path)
    prompt = tok.apply_chat_template(messages)
    assert prompt == "<|bos|>[SYSTEM] be brief<|eos|>[USER] hi<|eos|>[ASSISTANT]"
    assert tok.encode(prompt)[:2] == [256, ord("[")]  # the template's BOS is not doubled
    with pytest.raises(ChatTemplateError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_template_errors_are_chat_template_errors(tiny_llama: Path, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((tiny_llama / name).read_bytes())
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(ChatTemplateError, match="first must be user"):
        load(tmp_path).apply_chat_template([{"role": "system", "content": "x"}])


def test_builtin_tokenizer_is_the_builtin_model_directory_s() -> None:
    """The proxy counts prompt tokens with `Tokenizer.builtin()`: it must encode as the worker does."""
    path = builtin_model_path()
    from_dir, builtin = load(path), Tokenizer.builtin()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🐍"}]
    assert builtin.apply_chat_template(messages) == from_dir.apply_chat_template(messages)
    for text in ("def f(x):\n    return x", builtin.apply_chat_template(messages)):
        assert builtin.encode(text) == from_dir.encode(text)
    assert (builtin.bos_token_id, builtin.eos_token_ids) == (from_dir.bos_token_id, from_dir.eos_token_ids)


def test_a_directory_without_tokenizer_json_is_a_model_load_error(tmp_path: Path, tiny_llama: Path) -> None:
    (tmp_path / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load(tmp_path)
