"""Conditional disaggregation's pure parts: the policy, the prefix index, prompt counting, the flags."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from common.tokenizer import Tokenizer
from proxy import CHAT, COMPLETIONS, BadRequest, ConfigError, parse_args, parse_request
from proxy.conditional import LOCAL, REMOTE, ConditionalPolicy, prefill_queue
from proxy.prefix_index import PrefixIndex
from proxy.prompt_tokens import prompt_token_ids

STATIC = ["--prefill-ip", "127.0.0.1", "--prefill-port", "8100", "--decode-ip", "127.0.0.1", "--decode-port", "8200"]
BUILTIN = Tokenizer.builtin()


@pytest.mark.parametrize("prompt, cached, queue, path", [
    (100, 0, 0, LOCAL),       # short: the decode worker prefills it
    (101, 0, 0, REMOTE),      # longer than the threshold, prefill idle
    (101, 0, 1.5, REMOTE),    # the queue is under the threshold
    (101, 0, 2, LOCAL),       # the prefill side is busy: stay local
    (500, 400, 0, LOCAL),     # long, but most of it is cached on the decode worker
    (500, 399, 0, REMOTE),    # 101 uncached tokens
    (50, 80, 0, LOCAL),       # a cache estimate beyond the prompt counts as the whole prompt
    (101, 0, math.inf, LOCAL),  # no prefill worker at all
])
def test_policy_sends_only_long_uncached_prompts_to_an_idle_prefill_side(prompt: int, cached: int, queue: float,
                                                                         path: str) -> None:
    assert ConditionalPolicy(100, 2).path(prompt, cached, queue) == path


def test_policy_rejects_bad_thresholds() -> None:
    with pytest.raises(ValueError, match="max_local_prefill_tokens"):
        ConditionalPolicy(-1, 2)
    with pytest.raises(ValueError, match="max_prefill_queue"):
        ConditionalPolicy(10, 0)


def test_prefill_queue_is_legs_per_prefill_worker() -> None:
    assert prefill_queue([3, 1]) == 2.0 and prefill_queue([0]) == 0.0 and prefill_queue([]) == math.inf


def test_prefix_index_counts_whole_leading_blocks_but_never_the_last_tokens_block() -> None:
    index = PrefixIndex(block_size=4, capacity=100)
    doc = list(range(10))                      # blocks [0-3] [4-7], then 2 tokens
    assert index.cached_tokens(doc) == 0
    index.add(doc)
    assert len(index) == 2
    assert index.cached_tokens(doc + [99, 98]) == 8            # both full blocks match
    assert index.cached_tokens(doc[:8]) == 4                   # the block holding the last token is computed
    assert index.cached_tokens([0, 1, 2, 3, 7, 7, 7, 7, 1]) == 4  # the chain breaks at the second block
    assert index.cached_tokens([9] + doc) == 0                 # same tokens, other position: other hashes


def test_prefix_index_forgets_the_least_recently_used_blocks_beyond_its_capacity() -> None:
    index = PrefixIndex(block_size=2, capacity=4)
    first, second = [1, 1, 2, 2], [3, 3, 4, 4]
    index.add(first)
    index.add(second)
    assert index.cached_tokens(first + [0]) == 4   # a lookup makes them recent again
    index.add([5, 5, 6, 6])                        # evicts `second`'s blocks, the least recently used
    assert len(index) == 4
    assert index.cached_tokens(second + [0]) == 0 and index.cached_tokens(first + [0]) == 4


def test_prompt_token_ids_are_what_the_worker_encodes() -> None:
    completion = parse_request(COMPLETIONS, json.dumps({"model": "m", "prompt": "hi"}).encode(), True)
    assert prompt_token_ids(completion, BUILTIN) == [BUILTIN.bos_token_id, ord("h"), ord("i")]
    ids = parse_request(COMPLETIONS, json.dumps({"model": "m", "prompt": [[5, 6, 7]]}).encode(), True)
    assert prompt_token_ids(ids, BUILTIN) == [5, 6, 7]
    batch = parse_request(COMPLETIONS, json.dumps({"model": "m", "prompt": ["a", "b"]}).encode(), True)
    assert prompt_token_ids(batch, BUILTIN) is None
    messages = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    chat = parse_request(CHAT, json.dumps({"model": "m", "messages": messages}).encode(), True)
    text = BUILTIN.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt_token_ids(chat, BUILTIN) == BUILTIN.encode(text, add_bos=False)
    assert prompt_token_ids(chat, BUILTIN)[:1] == [BUILTIN.bos_token_id]  # the template's, not doubled


def test_a_chat_the_template_refuses_is_a_bad_request(tmp_path: Path) -> None:
    BUILTIN.inner.save(str(tmp_path / "tokenizer.json"))
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    conditional = parse_args([*STATIC, "--conditional-disaggregation", "--tokenizer", str(tmp_path)]).conditional
    assert conditional is not None
    chat = parse_request(CHAT, json.dumps({"model": "m", "messages": [{"role": "system"}]}).encode(), True)
    with pytest.raises(BadRequest, match="first must be user"):
        prompt_token_ids(chat, conditional.tokenizer)


def test_conditional_flags() -> None:
    assert parse_args(STATIC).conditional is None
    config = parse_args([*STATIC, "--conditional-disaggregation", "--tokenizer", "builtin",
                         "--max-local-prefill-tokens", "64", "--max-prefill-queue", "3", "--kv-block-size", "8"])
    assert config.conditional is not None
    assert (config.conditional.policy, config.conditional.block_size) == (ConditionalPolicy(64, 3), 8)


@pytest.mark.parametrize("flags, message", [
    (["--conditional-disaggregation"], "--conditional-disaggregation needs --tokenizer PATH|builtin"),
    (["--tokenizer", "builtin"], "--tokenizer: only with --conditional-disaggregation"),
    (["--max-prefill-queue", "3", "--kv-block-size", "8"],
     "--kv-block-size, --max-prefill-queue: only with --conditional-disaggregation"),
    (["--conditional-disaggregation", "--tokenizer", "builtin", "--max-prefill-queue", "0"],
     "--max-prefill-queue must be at least 1"),
    (["--conditional-disaggregation", "--tokenizer", "builtin", "--max-local-prefill-tokens", "-1"],
     "--max-local-prefill-tokens must be at least 0"),
    (["--conditional-disaggregation", "--tokenizer", "/nonexistent/model"], "--tokenizer /nonexistent/model: cannot load"),
])
def test_conditional_flag_errors(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("|", r"\|")):
        parse_args([*STATIC, *flags])


def test_conditional_disaggregation_is_for_di_mode() -> None:
    with pytest.raises(ConfigError, match="is for di mode"):
        parse_args(["--mode", "colocated", "--worker", "127.0.0.1:8100", "--conditional-disaggregation",
                    "--tokenizer", "builtin"])
