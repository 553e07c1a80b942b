"""Loading the model directory's tokenizer (common.tokenizer) for the engine, with the worker's errors."""
from __future__ import annotations

from pathlib import Path

from common.errors import TokenizerLoadError
from common.tokenizer import Tokenizer
from worker.errors import ModelLoadError
from worker.model.model_config import ModelConfig


def load_tokenizer(path: str | Path, config: ModelConfig) -> Tokenizer:
    """The tokenizer in `path`, with the model config's BOS and EOS ids; ModelLoadError if unusable."""
    try:
        return Tokenizer.from_dir(path, config.bos_token_id, config.eos_token_ids)
    except TokenizerLoadError as exc:
        raise ModelLoadError(str(exc)) from exc
