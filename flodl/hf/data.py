"""``dataset=hf``: text from local files, a saved ``datasets`` directory or a function,
tokenized with a local tokenizer and packed into fixed-length blocks once, then cached.

A causal-LM sample is ``{"input_ids": int64[block_size]}`` (consecutive blocks of the tokenized
text, documents joined by the end-of-text token); a classification sample (``label_column``
set) is ``{"input_ids", "attention_mask", "labels"}``, each text truncated and padded to
``block_size``. The tokenized tensors are cached under ``cache_dir`` keyed by the sources, the
tokenizer's files and the knobs, so every rank and every later run reads them instead of
tokenizing again (written atomically: two ranks racing write the same bytes).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from flodl.config import ConfigError, resolve_dotted
from flodl.recipes.datasets import _check_split, data_dir

__all__ = [
    "TokenBlocks",
    "dataset_tokenizer",
    "load_tokenizer",
    "text_dataset",
    "tokenizer_path",
    "train_tokenizer",
]

_MIN_BPE_VOCAB = 257
_FORMATS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class TokenBlocks(Dataset):
    """Dict samples over tensors of equal length (``input_ids`` and friends), one row each."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)
        self.n = len(next(iter(self.tensors.values())))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: t[i] for k, t in self.tensors.items()}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in indices]


def text_dataset(
    split: str,
    tokenizer: str | None = None,
    files: Sequence[str] | None = None,
    saved: str | None = None,
    text_fn: str | None = None,
    text_column: str = "text",
    label_column: str | None = None,
    block_size: int = 128,
    val_fraction: float = 0.1,
    max_chars: int | None = None,
    train_tokenizer_vocab: int | None = None,
    cache_dir: str | None = None,
) -> TokenBlocks:
    """The ``split`` ("train" or "test") of a text dataset, tokenized and packed (see module).
    Exactly one source: ``files`` (local .txt/.json/.jsonl/.csv/.parquet), ``saved`` (a
    ``Dataset.save_to_disk`` directory) or ``text_fn`` (dotted path: ``fn() -> str``).
    A ``test`` / ``validation`` split of the source validates; without one, the last
    ``val_fraction`` of the rows (of the text, for ``text_fn``) does. ``tokenizer``: a local
    tokenizer directory or ``tokenizer.json``; with ``train_tokenizer_vocab`` and no tokenizer
    there yet, a byte-level BPE of that size is trained on the train split and saved there."""
    split = _check_split(split, "hf")
    if train_tokenizer_vocab is not None and train_tokenizer_vocab < _MIN_BPE_VOCAB:
        raise ConfigError(
            f"dataset.train_tokenizer_vocab={train_tokenizer_vocab}: a byte-level BPE needs at "
            f"least {_MIN_BPE_VOCAB} tokens (256 bytes and <|endoftext|>)"
        )
    if sum(x is not None for x in (files, saved, text_fn)) != 1:
        raise ConfigError("dataset.files / dataset.saved / dataset.text_fn: set exactly one")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"dataset.val_fraction={val_fraction}: must be in (0, 1)")
    cache = data_dir("hf", cache_dir)
    sources = {"files": list(files or []), "saved": saved, "text_fn": text_fn}
    tokenizer = tokenizer_path(
        tokenizer, train_tokenizer_vocab, sources, text_column, val_fraction, max_chars, cache_dir
    )
    if not Path(tokenizer).expanduser().exists() and train_tokenizer_vocab:
        texts, _ = _rows("train", sources, text_column, None, val_fraction, max_chars, cache)
        train_tokenizer(texts, train_tokenizer_vocab, tokenizer)
    tok = load_tokenizer(tokenizer)
    knobs = [sources, text_column, label_column, block_size, val_fraction, max_chars, split]
    key = _cache_key(knobs, tokenizer, sources)
    path = cache / f"blocks-{key}.pt"
    if path.exists():
        return TokenBlocks(torch.load(path, weights_only=True))
    texts, labels = _rows(split, sources, text_column, label_column, val_fraction, max_chars, cache)
    if label_column is None:
        tensors = {"input_ids": _pack(tok, texts, block_size)}
    else:
        tensors = _encode_labelled(tok, texts, labels, block_size)
    _save_atomic(tensors, path)
    return TokenBlocks(tensors)


def _rows(
    split: str,
    sources: dict[str, Any],
    text_column: str,
    label_column: str | None,
    val_fraction: float,
    max_chars: int | None,
    cache: Path,
) -> tuple[list[str], list[Any] | None]:
    if sources["text_fn"] is not None:
        text = resolve_dotted(sources["text_fn"])()[:max_chars]
        cut = int(len(text) * (1 - val_fraction))
        return [text[:cut] if split == "train" else text[cut:]], None
    table = _table(sources, cache)
    part = _split(table, split, val_fraction)
    for column in (text_column, label_column):
        if column is not None and column not in part.column_names:
            raise ConfigError(
                f"dataset.{'text' if column == text_column else 'label'}_column={column}: "
                f"not a column of the dataset ({', '.join(part.column_names)})"
            )
    texts = list(part[text_column])
    labels = list(part[label_column]) if label_column is not None else None
    if max_chars is not None:
        kept, total = 0, 0
        while kept < len(texts) and total < max_chars:
            total += len(texts[kept])
            kept += 1
        texts, labels = texts[:kept], labels[:kept] if labels is not None else None
    return texts, labels


def _table(sources: dict[str, Any], cache: Path) -> Any:
    """The source as a ``datasets`` Dataset or DatasetDict (offline: local files only)."""
    import datasets

    if sources["saved"] is not None:
        where = Path(sources["saved"]).expanduser()
        if not where.exists():
            raise ConfigError(f"dataset.saved={sources['saved']}: no such directory")
        return datasets.load_from_disk(str(where))
    files = [Path(f).expanduser() for f in sources["files"]]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ConfigError(f"dataset.files: no such file: {', '.join(missing)}")
    kinds = {_FORMATS.get(f.suffix) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise ConfigError(
            f"dataset.files: one format of {', '.join(_FORMATS)}, got {[f.name for f in files]}"
        )
    return datasets.load_dataset(
        kinds.pop(),
        data_files=[str(f) for f in files],
        split="train",
        cache_dir=str(cache / "datasets"),
    )


def _split(table: Any, split: str, val_fraction: float) -> Any:
    import datasets

    if isinstance(table, datasets.DatasetDict):
        held = next((s for s in ("test", "validation") if s in table), None)
        if held is not None and "train" in table:
            return table["train" if split == "train" else held]
        table = table["train"] if "train" in table else next(iter(table.values()))
    cut = int(len(table) * (1 - val_fraction))
    return table.select(range(cut) if split == "train" else range(cut, len(table)))


def _pack(tok: Any, texts: list[str], block_size: int) -> torch.Tensor:
    """Documents joined by the end-of-text token, cut into consecutive ``block_size`` blocks
    (the tail that does not fill one is dropped)."""
    eos = tok.eos_token_id
    ids: list[int] = []
    for encoded in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        if eos is not None:
            ids.append(eos)
    n = len(ids) // block_size
    if n == 0:
        raise ConfigError(
            f"dataset.block_size={block_size}: the split has only {len(ids)} tokens, "
            "not one block; lower block_size or add text"
        )
    return torch.tensor(ids[: n * block_size], dtype=torch.int64).view(n, block_size)


def _encode_labelled(
    tok: Any, texts: list[str], labels: list[Any] | None, block_size: int
) -> dict[str, torch.Tensor]:
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    enc = tok(texts, truncation=True, max_length=block_size, padding="max_length")
    return {
        "input_ids": torch.tensor(enc["input_ids"], dtype=torch.int64),
        "attention_mask": torch.tensor(enc["attention_mask"], dtype=torch.int64),
        "labels": torch.tensor(labels, dtype=torch.int64),
    }


def tokenizer_path(
    tokenizer: str | None,
    train_tokenizer_vocab: int | None,
    sources: dict[str, Any],
    text_column: str,
    val_fraction: float,
    max_chars: int | None,
    cache_dir: str | None,
) -> str:
    """``tokenizer`` itself, else where the tokenizer trained on these sources is kept."""
    if tokenizer is not None:
        return tokenizer
    if not train_tokenizer_vocab:
        raise ConfigError(
            "dataset.tokenizer=null: name a local tokenizer, or set dataset.train_tokenizer_vocab"
        )
    knobs = [sources, text_column, val_fraction, max_chars, train_tokenizer_vocab]
    key = hashlib.sha256(json.dumps(knobs, sort_keys=True, default=str).encode()).hexdigest()
    return str(data_dir("hf", cache_dir) / f"tokenizer-bpe{train_tokenizer_vocab}-{key[:12]}")


def dataset_tokenizer(dataset: Mapping[str, Any]) -> str:
    """The tokenizer a ``dataset=hf`` config uses (given its keyword arguments), for the outputs."""
    bound = inspect.signature(text_dataset).bind("train", **dataset)
    bound.apply_defaults()
    a = bound.arguments
    sources = {"files": list(a["files"] or []), "saved": a["saved"], "text_fn": a["text_fn"]}
    return tokenizer_path(
        a["tokenizer"],
        a["train_tokenizer_vocab"],
        sources,
        a["text_column"],
        a["val_fraction"],
        a["max_chars"],
        a["cache_dir"],
    )


def load_tokenizer(path: str) -> Any:
    """A transformers tokenizer from a local directory or a ``tokenizer.json`` (never the Hub)."""
    import transformers

    where = Path(path).expanduser()
    if where.is_file():
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(where))
    if not where.is_dir():
        raise ConfigError(
            f"dataset.tokenizer={path}: no such tokenizer directory or file; save one with "
            "tokenizer.save_pretrained(path), or set dataset.train_tokenizer_vocab to train one"
        )
    return transformers.AutoTokenizer.from_pretrained(str(where), local_files_only=True)


def train_tokenizer(texts: Sequence[str], vocab_size: int, path: str) -> Any:
    """Train a byte-level BPE tokenizer on ``texts`` (deterministic) and save it as a
    transformers tokenizer directory at ``path`` (atomically); return it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, target)
    except OSError:  # another rank saved the same tokenizer first
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return tok


def _cache_key(knobs: list[Any], tokenizer: str, sources: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(knobs, sort_keys=True, default=str).encode())
    for f in [*_files_of(tokenizer), *(Path(s).expanduser() for s in sources["files"])]:
        digest.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    if sources["saved"] is not None:
        for f in _files_of(sources["saved"]):
            digest.update(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _files_of(path: str) -> list[Path]:
    where = Path(path).expanduser()
    return sorted(p for p in where.rglob("*") if p.is_file()) if where.is_dir() else [where]


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    torch.save(tensors, tmp)
    os.replace(tmp, path)
