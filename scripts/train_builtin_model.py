"""Trains the built-in model: a ~3M-parameter byte-level Llama on Python's own stdlib sources.

Deterministic for a given seed and thread count. Writes an HF-style directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) that the normal loader reads. The
defaults reproduce the shipped checkpoint (about 20 minutes on one core):

    nice python scripts/train_builtin_model.py --out worker/model/assets/builtin
"""
from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from worker.model.checkpoint import save_checkpoint
from worker.model.model_config import ModelConfig
from worker.model.llama import LlamaForCausalLM

BUILTIN_CONFIG = ModelConfig(
    vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
    bos_token_id=BOS_ID, eos_token_ids=[EOS_ID],
)


def load_corpus(max_bytes: int) -> bytes:
    """Stdlib .py files in sorted order, each ended by EOS so the model learns to stop."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\x00".join(chunks)[:max_bytes]


def to_ids(corpus: bytes) -> torch.Tensor:
    # Byte b is token b; the NUL separators become EOS.
    ids = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(torch.int64)
    ids[ids == 0] = EOS_ID
    return ids


def batches(ids: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=generator)
    return torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])


def loss_on(model: LlamaForCausalLM, rows: torch.Tensor) -> torch.Tensor:
    inputs, targets = rows[:, :-1], rows[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    logits = model.compute_logits(model(inputs, positions))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def save(model: LlamaForCausalLM, out: Path) -> None:
    # fp16 storage keeps the committed checkpoint small; the engine computes in its own dtype.
    save_checkpoint(model, out, dtype=torch.float16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("worker/model/assets/builtin"))
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-bytes", type=int, default=16 * 2**20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=200)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ids = to_ids(load_corpus(args.corpus_bytes))
    split = int(len(ids) * 0.98)
    train, val = ids[:split], ids[split:]
    model = LlamaForCausalLM(BUILTIN_CONFIG)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    print(f"corpus {len(ids)} bytes, {sum(p.numel() for p in model.parameters())} params", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.monotonic()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=50)
        loss = loss_on(model, batches(train, args.batch, args.seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.monotonic() - start:.0f}s)", flush=True)
        if (step + 1) % args.save_every == 0 or step == args.steps - 1:
            save(model, args.out)
    with torch.no_grad():
        val_gen = torch.Generator().manual_seed(args.seed + 1)
        val_loss = sum(loss_on(model, batches(val, args.batch, args.seq_len, val_gen)).item() for _ in range(8)) / 8
    print(f"validation loss {val_loss:.3f} nats/byte", flush=True)


if __name__ == "__main__":
    main()
