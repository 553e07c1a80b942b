"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) that loads and saves HF checkpoints."""
from __future__ import annotations

import torch
from torch import nn

from worker.model.layers.attention import AttentionMetadata, causal_attention, paged_attention
from worker.model.layers.linear import Linear
from worker.model.layers.pointwise import rms_norm, rotary, silu_mul
from worker.model.layers.rotary import RotaryEmbedding
from worker.model.model_config import ModelConfig

InputRows = tuple[torch.Tensor, torch.Tensor]   # (row indices (k,), embeddings (k, hidden))

# Checkpoints store q/k/v and gate/up separately; the model runs each group as one matmul.
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def pack_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF parameter names -> this model's (fused) names; parts missing from `state` stay missing."""
    packed = dict(state)
    for fused, parts in PACKED_MODULES.items():
        for name in [n for n in state if f".{parts[0]}." in n]:
            names = [name.replace(f".{parts[0]}.", f".{part}.") for part in parts]
            if all(n in state for n in names):
                packed[name.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat([packed.pop(n) for n in names])
    return packed


def unpack_checkpoint(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """This model's parameters under HF names, for saving a checkpoint others can load."""
    state = {}
    for name, tensor in model.state_dict().items():
        fused = next((f for f in PACKED_MODULES if f".{f}." in name), None)
        if fused is None:
            state[name] = tensor
            continue
        parts = PACKED_MODULES[fused]
        sizes = (model.model.layers[0].self_attn.sizes if fused == "qkv_proj"
                 else [model.config.intermediate_size] * 2)
        for part, chunk in zip(parts, tensor.split(sizes)):
            state[name.replace(f".{fused}.", f".{part}.")] = chunk
    return state


class Embedding(nn.Embedding):
    """nn.Embedding whose random init is skipped on "meta" (the loader's build, which assigns the checkpoint's
    weights): there torch's normal_ imports torch._dynamo, a second of every worker's start."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv_proj = Linear(config.hidden_size, sum(self.sizes), bias=config.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata | None) -> torch.Tensor:
        lead = x.shape[:-1]
        qk, v = self.qkv_proj(x).split([self.sizes[0] + self.sizes[1], self.sizes[2]], dim=-1)
        # q and k rotated as one tensor of heads: half the small ops of rotating each.
        qk = rotary(qk.view(*lead, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=-2)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        out = causal_attention(q, k, v) if meta is None else paged_attention(self.layer, q, k, v, meta)
        return self.o_proj(out.reshape(*lead, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def rotary_for(config: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                           config.rope_scaling)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rotary = rotary_for(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None, input_rows: InputRows | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if input_rows is not None:
            x[input_rows[0]] = input_rows[1]
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    With `meta` the input is a flat (tokens,) batch using the paged KV pool; without it the
    input is (batch, seq) with dense causal attention and no cache (used for training).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Deterministic random init (normal, as HF Llama) for training and benchmark models."""
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None = None, input_rows: InputRows | None = None) -> torch.Tensor:
        """Final hidden states; call `compute_logits` on the rows that need them. `input_rows`
        (indices into the flat input, embeddings) replace those inputs' token embeddings."""
        return self.model(input_ids, positions, meta, input_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
