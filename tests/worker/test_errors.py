"""Bad configuration, parameters and requests give clear, typed errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from worker import (EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, QueueFullError,
                    SamplingParams, WorkerError)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": "7"}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_single_stop_string_is_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 0}, "block_size"),
    ({"num_kv_blocks": -1}, "num_kv_blocks"),
    ({"max_num_seqs": True}, "max_num_seqs"),
    ({"max_waiting": 0}, "max_waiting"),
    ({"dtype": "int8"}, "dtype"),
    ({"role": "router"}, "role"),
    ({"max_model_len": 0}, "max_model_len"),
])
def test_bad_engine_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_bad_model_dirs(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(ModelLoadError, match="config"):
        LLMEngine(EngineConfig(model=str(tmp_path / "missing")))
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 4}')
    with pytest.raises(ModelLoadError):
        LLMEngine(EngineConfig(model=str(tmp_path / "gpt")))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(EngineConfig(model=str(tiny_llama), max_model_len=10_000))
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_bytes=16))


def test_bad_requests(tiny_llama: Path) -> None:
    eng = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=8, max_model_len=64))
    ok = SamplingParams(max_tokens=4)
    cases = [
        (("", [1], ok), "request_id"),
        (("a", [], ok), "empty"),
        (("a", [1, 999], ok), "token ids"),
        (("a", [1] * 60, SamplingParams(max_tokens=5)), "maximum model length"),
        (("a", [1] * 30, SamplingParams(max_tokens=5)), "KV blocks"),   # 35 tokens > 8 blocks * 4
        (("a", [1], {"max_tokens": 4}), "SamplingParams"),
    ]
    for args, match in cases:
        with pytest.raises(InvalidRequestError, match=match):
            eng.add_request(*args)
    eng.add_request("a", [1, 2], ok)
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("a", [1, 2], ok)
    assert issubclass(InvalidRequestError, WorkerError) and eng.stats().num_waiting == 1
    with pytest.raises(InvalidRequestError, match="idle"):
        eng.generate([[1, 2]], ok)


def test_waiting_queue_is_bounded(tiny_llama: Path) -> None:
    eng = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_waiting=3))
    for i in range(3):
        eng.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="full"):
        eng.add_request("r3", [1, 2, 3], SamplingParams(max_tokens=2))
    eng.step()  # the three start running, which makes room
    eng.add_request("r3", [1, 2, 3], SamplingParams(max_tokens=2))
