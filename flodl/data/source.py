"""Dataset plumbing: resolve what the user gave, derive each epoch's permutation, cut batches.

A dataset is anything map-style (``len`` and ``__getitem__``); a ``TensorDataset`` takes the fast
path (one gather per batch instead of one ``__getitem__`` per sample). Users may pass the dataset
itself or a zero-argument callable that builds it, which lets every rank load its own copy.
Samples may be tensors, tuples, dicts or nested structures: a batch is what the collate function
makes of them (``default_collate`` unless ``loader.collate_fn`` names another).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate

DatasetLike = Dataset | Callable[[], Dataset]
Collate = Callable[[list[Any]], Any]

SHARD_API = (
    "flodl.data.streams.ShardStream(shards, decode=...) "
    "(local files, fsspec URLs or webdataset tars)"
)


def resolve_dataset(source: Any, what: str = "dataset") -> Any:
    """Return a map-style dataset from a dataset or a factory; fail with a clear message."""
    # A factory: a function, a partial, or a Dataset class itself (its instances index; the
    # class only has the unbound method).
    factory = isinstance(source, type) or (callable(source) and not hasattr(source, "__getitem__"))
    dataset = source() if factory else source
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"{what} is an IterableDataset without shards: flodl's controller plans which "
            f"samples each rank trains, so it needs a map-style dataset, or shards it can "
            f"dispatch: {SHARD_API}"
        )
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"{what} must be a map-style dataset (len + indexing), got {type(dataset)}")
    if len(dataset) == 0:
        raise ValueError(f"{what} is empty: nothing to train on")
    return dataset


def epoch_permutation(n_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation every rank derives for ``epoch`` (seeded by ``seed + epoch``)."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n_samples, generator=generator)


def chunk_batches(chunks: Sequence[tuple[int, int]], batch_size: int) -> Iterator[range]:
    """The permutation positions of each batch of ``chunks`` (a batch never spans two chunks)."""
    for offset, size in chunks:
        for start in range(offset, offset + size, batch_size):
            yield range(start, min(start + batch_size, offset + size))


def count_batches(chunks: Sequence[tuple[int, int]], batch_size: int) -> int:
    return sum(-(-size // batch_size) for _, size in chunks)


def tree_map(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``fn`` on every tensor of a (nested) list, tuple or dict; other leaves pass through."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, tree_map(fn, v)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(tree_map(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(tree_map(fn, v) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor of ``batch`` to ``device`` (asynchronously from pinned memory)."""
    if device.type == "cpu":
        return batch
    return tree_map(lambda t: t.to(device, non_blocking=True), batch)


def batch_samples(batch: Any) -> int | None:
    """Samples in a batch: the leading dimension of its first tensor (None: no tensor found)."""
    found: list[int] = []

    def first(t: torch.Tensor) -> torch.Tensor:
        if not found and t.dim():
            found.append(int(t.shape[0]))
        return t

    tree_map(first, batch)
    return found[0] if found else None


def fetch(dataset: Any, indices: Sequence[int], collate: Collate) -> Any:
    """One batch the way a DataLoader worker makes it: ``__getitems__`` when the dataset has
    one, else one ``__getitem__`` per index, then ``collate``."""
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(list(indices)) if getitems is not None else [dataset[i] for i in indices]
    return collate(samples)


class BatchSource:
    """Cuts batches out of ranges of an epoch permutation, in the training thread.

    The fast path of a ``TensorDataset`` (one index per tensor, on the device it lives on) and
    the inline path of ``loader.num_workers=0``."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        seed: int,
        device: torch.device,
        collate: Collate | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.device = device
        self.collate: Collate = collate or default_collate
        self._tree: Any = list(dataset.tensors) if isinstance(dataset, TensorDataset) else None
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def fast(self) -> bool:
        """Batches are index gathers of tensors (no per-sample Python)."""
        return self._tree is not None

    def resident(self, tree: Any) -> None:
        """Serve batches by indexing ``tree`` (the whole dataset collated, on its device);
        ``None``: gather sample by sample."""
        self._tree = tree

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            order = getattr(self.dataset, "epoch_order", None)  # a ShardStream's, shard-grouped
            self._perm = (
                order(self.seed, epoch)
                if order is not None
                else epoch_permutation(len(self.dataset), self.seed, epoch)
            )
            self._perm_epoch = epoch
        return self._perm

    def gather(self, indices: torch.Tensor) -> Any:
        if self._tree is not None:
            device = self.device

            def take(t: torch.Tensor) -> torch.Tensor:
                idx = indices if t.device.type == "cpu" else indices.to(t.device)
                # index_select: the same rows as t[idx], without advanced indexing's general
                # machinery (measured on CPU: 42 against 92 us for 64 MNIST images)
                rows = t.index_select(0, idx)
                return rows if rows.device == device else rows.to(device, non_blocking=True)

            return tree_map(take, self._tree)
        return to_device(fetch(self.dataset, indices.tolist(), self.collate), self.device)

    def batches(self, epoch: int, chunks: Sequence[tuple[int, int]]) -> Iterator[Any]:
        perm = self.permutation(epoch)
        for positions in chunk_batches(chunks, self.batch_size):
            yield self.gather(perm[positions.start : positions.stop])

    def sequential(
        self, batch_size: int | None = None, start: int = 0, stop: int | None = None
    ) -> Iterator[Any]:
        """Samples ``[start, stop)`` in order (evaluation; default: all of them)."""
        step = batch_size or max(self.batch_size, 256)
        end = len(self.dataset) if stop is None else min(stop, len(self.dataset))
        for first in range(start, end, step):
            idx = torch.arange(first, min(first + step, end))
            yield self.gather(idx)
