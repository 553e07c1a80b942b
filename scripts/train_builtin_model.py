"""Trains the built-in model: a ~3M-parameter byte-level Llama on Python's own stdlib, as code and as chat.

Training rows come from two streams, mixed by --chat-share. Code: the stdlib's .py files in sorted
order, each ended by EOS. Chat: turns rendered with the model's own chat template, in which a user
names a documented public function or class of those files (its `def`/`class` line, or "What does
NAME do?") and the assistant answers with the first paragraph of its docstring, then EOS. Both keep
ASCII bytes only, so the model never learns to emit a byte outside printable text and whitespace: its
text means little (it is tiny), but it is never a broken character.

Deterministic for a given seed and thread count. Writes an HF-style directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json) that the normal loader reads; the weights are
stored in float16 to keep the checkpoint small, and config.json names float32, the dtype the worker
computes in. The shipped checkpoint comes from these two runs on one core, so its text is printable
ASCII: 2000 of 3000 steps on 256-byte rows (about 25 minutes), then 200 steps on 1024-byte rows from
there, so that long prompts read on (about 7 minutes on an idle core; validation loss 1.29 nats per
token on code, 1.16 on chat).

    nice python scripts/train_builtin_model.py --stop-after 2000 --out /tmp/builtin-short
    nice python scripts/train_builtin_model.py --init /tmp/builtin-short --steps 200 --seq-len 1024 \
        --batch 4 --lr 1e-3 --out worker/model/assets/builtin
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
from common.tokenizer import Tokenizer
from worker.model.checkpoint import save_checkpoint
from worker.model.loader import load_model
from worker.model.model_config import ModelConfig
from worker.model.llama import LlamaForCausalLM

BUILTIN_CONFIG = ModelConfig(
    vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
    bos_token_id=BOS_ID, eos_token_ids=[EOS_ID],
)


def stdlib_files() -> list[Path]:
    """The standard library's own .py files. Its tests and site-packages (where an interpreter can hold
    hundreds of MB of packages) are not walked at all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("test", "site-packages")]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(found)


def ascii_text(data: bytes) -> str:
    """`data` with every byte outside printable ASCII and whitespace dropped."""
    return bytes(b for b in data if 32 <= b < 127 or b in b"\t\n").decode("ascii")


def code_ids(files: list[Path], max_bytes: int) -> torch.Tensor:
    """The files' ASCII text as byte ids, each file ended by EOS so the model learns to stop."""
    ids: list[int] = []
    for path in files:
        ids += ascii_text(path.read_bytes()).encode() + bytes([0])
        if len(ids) >= max_bytes:
            break
    tensor = torch.tensor(ids[:max_bytes], dtype=torch.int64)
    tensor[tensor == 0] = EOS_ID
    return tensor


def documented(files: list[Path], max_bytes: int) -> list[tuple[str, str, str]]:
    """(name, `def`/`class` line, first docstring paragraph) of the public functions and classes in `files`."""
    found: list[tuple[str, str, str]] = []
    read = 0
    for path in files:
        data = path.read_bytes()
        read += len(data)
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name[0] == "_":
                continue
            doc = " ".join(ascii_text((ast.get_docstring(node) or "").split("\n\n")[0].encode()).split())
            if len(doc) < 8:
                continue
            head = f"class {node.name}:" if isinstance(node, ast.ClassDef) else \
                f"def {node.name}({ascii_text(ast.unparse(node.args).encode())}):"
            found.append((node.name, head, doc))
        if read >= max_bytes:
            break
    return found


def chat_ids(items: list[tuple[str, str, str]], seed: int) -> torch.Tensor:
    """Chat turns about `items`, in a seeded order: one turn per question form, some after an earlier turn."""
    tokenizer = Tokenizer.builtin()
    turns = [(question, doc) for name, head, doc in items for question in (head, f"What does {name} do?")]
    random.Random(seed).shuffle(turns)
    ids: list[int] = []
    for i, (question, answer) in enumerate(turns):
        messages = [{"role": "user", "content": question}]
        if i % 4 == 3:  # a second turn: the history as a chat client resends it
            earlier_question, earlier_answer = turns[i - 1]
            messages = [{"role": "user", "content": earlier_question},
                        {"role": "assistant", "content": earlier_answer}, *messages]
        ids += tokenizer.encode(tokenizer.apply_chat_template(messages) + answer) + [EOS_ID]
    return torch.tensor(ids, dtype=torch.int64)


def batches(code: torch.Tensor, chat: torch.Tensor, chat_share: float, batch: int, seq_len: int,
            generator: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(batch):
        stream = chat if torch.rand((), generator=generator).item() < chat_share else code
        start = int(torch.randint(0, len(stream) - seq_len - 1, (), generator=generator))
        rows.append(stream[start:start + seq_len + 1])
    return torch.stack(rows)


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
    save_checkpoint(model, out, dtype=torch.float16)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "float32"  # what the model runs in: the worker computes in float32
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("worker/model/assets/builtin"))
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--corpus-bytes", type=int, default=16 * 2**20, help="stdlib bytes read")
    parser.add_argument("--chat-share", type=float, default=0.3, help="share of the rows that are chat turns")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument("--stop-after", type=int, help="save and stop after this many of the --steps")
    parser.add_argument("--init", type=Path, help="start from this checkpoint instead of random weights")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    files = stdlib_files()
    code, chat = code_ids(files, args.corpus_bytes), chat_ids(documented(files, args.corpus_bytes), args.seed)
    split_code, split_chat = int(len(code) * 0.98), int(len(chat) * 0.98)
    if args.init is not None:
        model = load_model(args.init, BUILTIN_CONFIG, torch.float32).train().requires_grad_(True)
    else:
        model = LlamaForCausalLM(BUILTIN_CONFIG)
        model.init_weights(torch.Generator().manual_seed(args.seed))
    print(f"code {len(code)} bytes, chat {len(chat)} tokens, {sum(p.numel() for p in model.parameters())} params",
          flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.monotonic()
    last = min(args.steps, args.stop_after or args.steps) - 1
    for step in range(last + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=50)
        rows = batches(code[:split_code], chat[:split_chat], args.chat_share, args.batch, args.seq_len, gen)
        loss = loss_on(model, rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == last:
            print(f"step {step} loss {loss.item():.3f} ({time.monotonic() - start:.0f}s)", flush=True)
        if (step + 1) % args.save_every == 0 or step == last:
            save(model, args.out)
    with torch.no_grad():
        for name, held_out, share in (("code", code[split_code:], 0.0), ("chat", chat[split_chat:], 1.0)):
            val_gen = torch.Generator().manual_seed(args.seed + 1)
            val = sum(loss_on(model, batches(held_out, held_out, share, args.batch, args.seq_len, val_gen)).item()
                      for _ in range(8)) / 8
            print(f"validation loss, {name}: {val:.3f} nats/token", flush=True)


if __name__ == "__main__":
    main()
