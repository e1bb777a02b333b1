"""Tokenizer access: a checkpoint's own (transformers), or a byte tokenizer for synthetic weights.

ByteTokenizer: id = byte + 3 after BOS. It lets text prompts and text corpora run on the tiny and
synthetic models (vocab >= 259), so the text paths are tested without a downloaded tokenizer.
"""
from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    offset = 3

    def __init__(self, vocab_size: int, bos_id: int = 2, eos_id: int = 1):
        if vocab_size < 256 + self.offset:
            raise ValueError(f"tokenizer=bytes needs a vocabulary of >= {256 + self.offset} ids, the model has {vocab_size}")
        self.vocab_size, self.bos_token_id, self.eos_token_id = vocab_size, bos_id, eos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        data = bytes(t - self.offset for t in ids if self.offset <= t < 256 + self.offset)
        return data.decode("utf-8", errors="replace")


def make_tokenizer(spec: str | None, weights_dir, vocab_size: int, bos_id: int, eos_id: int):
    """spec: "auto" (the checkpoint's own; the byte tokenizer for synthetic weights, which have none),
    "bytes", "none", or a directory with a tokenizer."""
    from ..weights.hf import load_tokenizer

    if spec in (None, "none"):
        return None
    if spec == "bytes":
        return ByteTokenizer(vocab_size, bos_id, eos_id)
    if spec == "auto":
        if weights_dir is None:  # synthetic weights: any text maps to ids, none of it means anything
            return ByteTokenizer(vocab_size, bos_id, eos_id)
        return load_tokenizer(weights_dir)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist (tokenizer= takes auto, bytes, none or a directory)")
    tok = load_tokenizer(path)
    if tok is None:
        raise FileNotFoundError(f"{path} holds no tokenizer.json / tokenizer.model / tokenizer_config.json")
    return tok


def encode(tokenizer, text: str) -> list[int]:
    """Text -> ids with BOS (transformers' Gemma tokenizers add it themselves)."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    return list(ids)


def encode_chat(tokenizer, text: str) -> list[int]:
    """Text as one user turn through the tokenizer's chat template, the model's turn opened after it (an
    instruction-tuned checkpoint's format: its reply then ends at its end-of-turn id, one of the model's EOS)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("task.chat=true needs a tokenizer with a chat template (an instruction-tuned checkpoint's "
                         f"own, tokenizer=auto or tokenizer=<dir>); this {type(tokenizer).__name__} has none")
    # the template's text, then its ids: it writes <bos> itself (tokenize=True returns a dict or a list by version)
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return encode_plain(tokenizer, s)


def encode_plain(tokenizer, text: str) -> list[int]:
    """Text -> ids without special tokens (corpus bodies, which the caller splits and prefixes)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def tokenizer_for(spec: str | None, weights, cfg):
    """make_tokenizer for a model config and a weights object (the checkpoint's directory, if it has one)."""
    src = getattr(weights, "source_dir", None) if weights is not None else None
    return make_tokenizer(spec, src, cfg.vocab_size, cfg.bos_id, cfg.eos_ids[0])
