"""The reference worker engine: a Llama-family model, paged KV cache, continuous batching."""
from __future__ import annotations

from worker.bench_model import create_bench_model
from worker.config import EngineConfig
from worker.engine import EngineStats, LLMEngine, RequestOutput, zeros_pool
from worker.errors import InvalidRequestError, KVTransferError, ModelLoadError, QueueFullError, WorkerError
from worker.kv_connector import KVConnector, KVConnectorConfig
from worker.loader import BUILTIN_MODEL_NAME, builtin_model_path
from worker.sampling_params import SamplingParams
from worker.tokenizer import Tokenizer

__all__ = [
    "BUILTIN_MODEL_NAME", "EngineConfig", "EngineStats", "InvalidRequestError", "KVConnector",
    "KVConnectorConfig", "KVTransferError", "LLMEngine", "ModelLoadError", "QueueFullError", "RequestOutput", "SamplingParams", "Tokenizer", "WorkerError",
    "builtin_model_path", "create_bench_model", "zeros_pool",
]

# The OpenAI server on top of the engine.
from worker.async_engine import AsyncEngine, RequestStream  # noqa: E402
from worker.server import create_app  # noqa: E402

__all__ += ["AsyncEngine", "RequestStream", "create_app"]
