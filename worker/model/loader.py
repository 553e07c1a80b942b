"""Loading a Llama-family checkpoint directory (single or sharded safetensors)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from worker.errors import ModelLoadError
from worker.model.model_config import ModelConfig
from worker.model.llama import LlamaForCausalLM, pack_checkpoint

BUILTIN_MODEL_NAME = "neuron-di-builtin"
# What a user should know before reading the built-in model's text.
BUILTIN_MODEL_NOTE = ("the built-in model is tiny (~3M parameters, one token per byte, trained for half an hour on "
                      "one core on Python's standard library): its text reads like Python and docstrings but means "
                      "little; --model PATH serves a real one")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints still store


def builtin_model_path() -> Path:
    return Path(__file__).resolve().parent / "assets" / "builtin"


def load_config(path: str | Path) -> ModelConfig:
    try:
        return ModelConfig.from_dir(path)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"malformed {index}: {exc!r}") from exc
        return [path / name for name in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    return files


def load_model(path: str | Path, config: ModelConfig, dtype: torch.dtype) -> LlamaForCausalLM:
    """Builds the model and fills every parameter from the checkpoint; missing ones are an error."""
    path = Path(path)
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            state.update(load_file(str(file)))
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"cannot read weights {file}: {exc}") from exc
    state = pack_checkpoint({k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ModelLoadError(f"checkpoint {path} does not match the {config.model_type} architecture: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
