"""Sharded datasets: samples stored in a list of shards (local files or fsspec URLs).

The reference format is webdataset's: a shard is a tar whose members are grouped by key
(``000017.png`` + ``000017.cls`` make one sample ``{"png": b"...", "cls": b"..."}``); ``decode``
turns that dict into the sample ``train_step`` sees (default: the dict of bytes).

A :class:`ShardStream` is map-style over its shards (an index of member offsets, built once by
reading the tar headers), so the controller plans it like any dataset: throughput-proportional
chunks, every sample exactly once per epoch, a lost rank's unfinished chunks reassigned. Its
epoch order (:meth:`ShardStream.epoch_order`) shuffles the shards, then the samples inside each
shard, so consecutive positions (a chunk) stay inside few shards and a rank reads each of its
shards front to back. Dispatch is by sample chunks over that shard-grouped order, not by whole
shards.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

Sample = dict[str, bytes]


def _open(url: str, mode: str = "rb") -> Any:
    """A local path with ``open``; anything with a scheme through fsspec (when installed)."""
    if "://" not in url or url.startswith("file://"):
        return open(url.removeprefix("file://"), mode)
    try:
        import fsspec
    except ImportError:
        raise ValueError(f"shard {url!r}: reading URLs needs fsspec (pip install fsspec)") from None
    return fsspec.open(url, mode).open()


def _index_tar(url: str) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """``(key, {extension: (offset, size)})`` per sample of a tar shard, in shard order."""
    samples: dict[str, dict[str, tuple[int, int]]] = {}
    with _open(url) as fh, tarfile.open(fileobj=fh, mode="r:") as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.partition(".")
            samples.setdefault(key, {})[ext] = (member.offset_data, member.size)
    return list(samples.items())


class ShardStream(Dataset):
    """The samples of ``shards`` (tar files or URLs, webdataset layout), in shard order."""

    def __init__(self, shards: Sequence[str], decode: Callable[[Sample], Any] | None = None):
        if isinstance(shards, str) or not shards:
            raise ValueError("shards: give a non-empty list of shard paths or URLs")
        self.shards = list(shards)
        self.decode = decode
        self.index: list[tuple[int, str, dict[str, tuple[int, int]]]] = []
        self.bounds: list[tuple[int, int]] = []  # (first sample, samples) of each shard
        for s, url in enumerate(self.shards):
            entries = _index_tar(url)
            self.bounds.append((len(self.index), len(entries)))
            self.index.extend((s, key, members) for key, members in entries)
        self._handles: dict[int, Any] = {}  # per process (DataLoader worker): open shards

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Any:
        shard, key, members = self.index[i]
        fh = self._handles.get(shard)
        if fh is None:
            fh = self._handles[shard] = _open(self.shards[shard])
        sample: Sample = {"__key__": key.encode()}
        for ext, (offset, size) in members.items():
            fh.seek(offset)
            sample[ext] = fh.read(size)
        return self.decode(sample) if self.decode is not None else sample

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}  # open files stay in their process

    @property
    def shard_sizes(self) -> list[int]:
        """Samples per shard: the controller cuts chunks on shard boundaries with them."""
        return [n for _, n in self.bounds]

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        """The epoch's permutation every rank derives: shards shuffled, then each shard's
        samples shuffled in place, so a chunk of consecutive positions spans few shards."""
        g = torch.Generator().manual_seed(seed + epoch)
        parts = []
        for s in _shard_order(len(self.shards), g):
            first, n = self.bounds[s]
            parts.append(first + torch.randperm(n, generator=g))
        return torch.cat(parts)


def _shard_order(n_shards: int, generator: torch.Generator) -> list[int]:
    return [int(s) for s in torch.randperm(n_shards, generator=generator)]


def shard_boundaries(sizes: Sequence[int], seed: int, epoch: int) -> list[int]:
    """Where each shard starts in the epoch's order (:meth:`ShardStream.epoch_order`); the
    controller derives it from the shard sizes the ranks report."""
    g = torch.Generator().manual_seed(seed + epoch)
    starts, pos = [], 0
    for s in _shard_order(len(sizes), g):
        starts.append(pos)
        pos += sizes[s]
    return starts
