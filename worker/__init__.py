"""The reference worker: a Llama-family model, a paged KV cache and continuous batching, served
over the same OpenAI API as `vllm serve`.

    worker/server/   the HTTP server, the engine thread behind it, the command line
    worker/engine/   LLMEngine: the request table, schedule / run / postprocess, the DI roles
    worker/model/    the model, its layers, tokenizer and sampler, and loading them

The names below are imported on first use, so `python -m worker --help` loads no torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EngineConfig": "worker.config",
    "SamplingParams": "worker.sampling_params",
    "InvalidRequestError": "worker.errors", "KVTransferError": "worker.errors", "ModelLoadError": "worker.errors",
    "QueueFullError": "worker.errors", "WorkerError": "worker.errors",
    "EngineStats": "worker.engine.llm_engine", "LLMEngine": "worker.engine.llm_engine",
    "zeros_pool": "worker.engine.llm_engine",
    "RequestOutput": "worker.engine.request",
    "KVConnector": "worker.engine.kv_connector", "KVConnectorConfig": "worker.engine.kv_connector",
    "BUILTIN_MODEL_NAME": "worker.model.loader", "builtin_model_path": "worker.model.loader",
    "Tokenizer": "common.tokenizer",
    "create_bench_model": "worker.model.bench_model",
    "AsyncEngine": "worker.server.async_engine", "RequestStream": "worker.server.async_engine",
    "create_app": "worker.server.app",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from common.tokenizer import Tokenizer
    from worker.config import EngineConfig
    from worker.engine.kv_connector import KVConnector, KVConnectorConfig
    from worker.engine.llm_engine import EngineStats, LLMEngine, zeros_pool
    from worker.engine.request import RequestOutput
    from worker.errors import InvalidRequestError, KVTransferError, ModelLoadError, QueueFullError, WorkerError
    from worker.model.bench_model import create_bench_model
    from worker.model.loader import BUILTIN_MODEL_NAME, builtin_model_path
    from worker.sampling_params import SamplingParams
    from worker.server.app import create_app
    from worker.server.async_engine import AsyncEngine, RequestStream
