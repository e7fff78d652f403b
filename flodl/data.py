"""Dataset plumbing: resolve what the user gave, derive each epoch's permutation, cut batches.

A dataset is anything map-style (``len`` and ``__getitem__``); a ``TensorDataset`` takes the fast
path (one gather per batch instead of one ``__getitem__`` per sample). Users may pass the dataset
itself or a zero-argument callable that builds it, which lets every rank load its own copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

DatasetLike = Dataset | Callable[[], Dataset]


def resolve_dataset(source: Any, what: str = "dataset") -> Any:
    """Return a map-style dataset from a dataset or a factory; fail with a clear message."""
    dataset = source() if callable(source) and not hasattr(source, "__getitem__") else source
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"{what} must be a map-style dataset (len + indexing), got {type(dataset)}")
    if len(dataset) == 0:
        raise ValueError(f"{what} is empty: nothing to train on")
    return dataset


def epoch_permutation(n_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation every rank derives for ``epoch`` (seeded by ``seed + epoch``)."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n_samples, generator=generator)


class BatchSource:
    """Cuts batches out of ranges of an epoch permutation and moves them to the device."""

    def __init__(self, dataset: Any, batch_size: int, seed: int, device: torch.device) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.device = device
        self._tensors = dataset.tensors if isinstance(dataset, TensorDataset) else None
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.dataset)

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            self._perm = epoch_permutation(len(self.dataset), self.seed, epoch)
            self._perm_epoch = epoch
        return self._perm

    def gather(self, indices: torch.Tensor) -> list[torch.Tensor]:
        if self._tensors is not None:
            parts = [t[indices] for t in self._tensors]
        else:
            parts = list(default_collate([self.dataset[int(i)] for i in indices]))
        return [p.to(self.device, non_blocking=True) for p in parts]

    def batches(
        self, epoch: int, chunks: Sequence[tuple[int, int]]
    ) -> Iterator[list[torch.Tensor]]:
        perm = self.permutation(epoch)
        for offset, size in chunks:
            for start in range(offset, offset + size, self.batch_size):
                stop = min(start + self.batch_size, offset + size)
                yield self.gather(perm[start:stop])

    def sequential(
        self, batch_size: int | None = None, start: int = 0, stop: int | None = None
    ) -> Iterator[list[torch.Tensor]]:
        """Samples ``[start, stop)`` in order (evaluation; default: all of them)."""
        step = batch_size or max(self.batch_size, 256)
        end = len(self.dataset) if stop is None else min(stop, len(self.dataset))
        for first in range(start, end, step):
            idx = torch.arange(first, min(first + step, end))
            yield self.gather(idx)
