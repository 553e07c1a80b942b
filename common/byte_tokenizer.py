"""The byte-level tokenizer of the built-in model: one token per byte plus a few specials.

Token id b (0-255) is the byte b, so any text round-trips; decoding a cut UTF-8 sequence
gives U+FFFD, which the incremental detokenizer holds back until the sequence completes.
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>")
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = SPECIAL_TOKENS[:3]
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_to_char() -> dict[int, str]:
    # Printable bytes stand for themselves; the rest are shifted past 255 so every byte has a
    # visible, whitespace-free character (the byte-level convention the ByteLevel decoder expects).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_byte_tokenizer() -> Tokenizer:
    vocab = {char: b for b, char in _byte_to_char().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer
