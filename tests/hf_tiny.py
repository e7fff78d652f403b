"""Tiny, offline Hugging Face objects for the tests: a GPT-2 built from a config, a BPE
tokenizer trained on a generated text, both saved where ``from_pretrained`` reads them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

VOCAB = 300  # a byte-level BPE holds 256 byte tokens and <|endoftext|> before any merge
BLOCK = 16
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "and",
    "cat",
    "runs",
    "far",
    "away",
    "from",
    "home",
]


def text(n_words: int = 3000, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n_words // 12)]
    return "\n".join(lines)


def gpt2_config(**over: Any) -> dict[str, Any]:
    """``model.config`` of a 2-layer GPT-2 with 32-wide embeddings."""
    fields = {
        "model_type": "gpt2",
        "vocab_size": VOCAB,
        "n_positions": BLOCK,
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    return fields | over


LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["c_attn"], "fan_in_fan_out": True}


def tokenizer_dir(root: Path) -> Path:
    """A byte-level BPE of ``VOCAB`` tokens trained on :func:`text`, saved at ``root/tok``."""
    from flodl.hf.data import train_tokenizer

    path = root / "tok"
    if not path.exists():
        train_tokenizer([text()], VOCAB, str(path))
    return path


def text_file(root: Path) -> Path:
    path = root / "corpus.txt"
    if not path.exists():
        path.write_text(text())
    return path


def pretrained_dir(root: Path, seed: int = 0) -> Path:
    """A tiny GPT-2 saved with ``save_pretrained`` (safetensors) at ``root/gpt2-<seed>``."""
    import torch
    import transformers

    path = root / f"gpt2-{seed}"
    if not path.exists():
        torch.manual_seed(seed)
        fields = gpt2_config()
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path
