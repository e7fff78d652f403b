"""Each rank's loader: a torch DataLoader fed by the controller's plan, one window ahead.

The plan is the source of truth. The rank feeds every window it knows of (the one it is about
to train and those already waiting in its inbox) to a :class:`PlanSampler`, a batch sampler that
lives in the rank's main process: the DataLoader's iterator pulls index batches from it and
hands them to its (persistent) worker processes, so the workers load the next window while the
current one trains, and nothing but planned indices is ever loaded. A window the controller
voids after it was fed is cancelled: its batches not yet handed out are dropped, those in
flight are discarded unseen.

The DataLoader's iterator lives for the whole run. When the sampler has nothing planned it hands
out a *filler* (one cheap placeholder index the workers answer at once) instead of blocking, so
the iterator never ends and its workers never respawn.

A receiver thread takes the workers' batches off the iterator as they arrive, as torch's
pin-memory thread does on CUDA: rebuilding a batch in the rank (each tensor's shared memory comes
as its own file descriptor) costs ~2 ms per batch that would otherwise be on the training
thread's critical path. It asks the workers for more only while something planned is queued or
in flight, so an idle rank does not spin on fillers.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from flodl.config import ConfigError, LoaderConfig
from flodl.data.source import (
    SHARD_API,
    BatchSource,
    Collate,
    chunk_batches,
    count_batches,
    to_device,
)

log = logging.getLogger(__name__)

FILLER = -1  # the index of a filler batch


class _Filler:
    """What a filler batch is, after the workers and the pin-memory thread."""


class PlanDataset(Dataset):
    """The user's dataset, answering the filler index with a placeholder (picklable)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return _Filler() if index == FILLER else self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        if indices == [FILLER]:
            return [_Filler()]
        getitems = getattr(self.dataset, "__getitems__", None)
        return list(getitems(indices)) if getitems else [self.dataset[i] for i in indices]


class PlanCollate:
    """The run's collate function; a filler stays a filler (picklable)."""

    def __init__(self, collate: Collate) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Any:
        if len(samples) == 1 and isinstance(samples[0], _Filler):
            return samples[0]
        return self.collate(samples)


class _PlanIterator:
    """The sampler's one iterator: planned index batches in order, else a filler."""

    def __init__(self, sampler: PlanSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> _PlanIterator:
        return self

    def __next__(self) -> list[int]:
        return self.sampler.hand_out()


class PlanSampler:
    """A batch sampler fed window by window; it records the window of every batch it hands out,
    in the order the DataLoader will return them. Fed by the training thread, read by the
    receiver's: every change is made under :attr:`changed`."""

    def __init__(self) -> None:
        self.queued: collections.deque[tuple[Hashable, list[int]]] = collections.deque()
        self.handed: collections.deque[Hashable | None] = collections.deque()  # None: filler
        self.fillers = 0
        self.changed = threading.Condition()

    def put(self, key: Hashable, batches: Sequence[list[int]]) -> None:
        with self.changed:
            self.queued.extend((key, b) for b in batches)
            self.changed.notify_all()

    def drop(self, key: Hashable) -> int:
        """Forget ``key``'s batches not handed out yet; returns how many there were."""
        with self.changed:
            kept = [(k, b) for k, b in self.queued if k != key]
            dropped = len(self.queued) - len(kept)
            self.queued = collections.deque(kept)
            return dropped

    def hand_out(self) -> list[int]:
        with self.changed:
            if self.queued:
                key, indices = self.queued.popleft()
                self.handed.append(key)
                return indices
            self.handed.append(None)
            self.fillers += 1
            return [FILLER]

    def returned(self) -> Hashable | None:
        """The window of the batch the DataLoader just returned (``None``: a filler)."""
        with self.changed:
            return self.handed.popleft()

    def has_work(self) -> bool:
        """Something planned is queued or in flight (else the workers hold only fillers; in
        flight are at most ``num_workers x prefetch_factor``)."""
        return bool(self.queued) or any(key is not None for key in self.handed)

    def __iter__(self) -> Iterator[list[int]]:
        return _PlanIterator(self)

    def __len__(self) -> int:  # DataLoader asks only to size a progress bar; none here
        return 1 << 62


class _Failed:
    """What the receiver hands on when the DataLoader raised (a worker's error, a dead worker)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


#: Batches the receiver holds ready beyond the workers' ``num_workers x prefetch_factor`` in
#: flight: the next one and one more, so a rank holds at most two batches more than torch's own
#: DataLoader would.
READY = 2


class _Receiver:
    """The thread that takes planned batches off the DataLoader's iterator, in order, onto a
    bounded queue the training thread reads (fillers are not passed on)."""

    def __init__(self, iterator: Any, sampler: PlanSampler) -> None:
        self.iterator = iterator
        self.sampler = sampler
        self.ready: queue.Queue[tuple[Hashable, Any] | _Failed] = queue.Queue(maxsize=READY)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flodl-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sampler = self.sampler
        while True:
            with sampler.changed:
                sampler.changed.wait_for(lambda: self._stop.is_set() or sampler.has_work())
            if self._stop.is_set():
                return
            try:
                batch = next(self.iterator)
            except BaseException as error:  # handed to the training thread, raised there
                self._put(_Failed(error))
                return
            key = sampler.returned()
            if key is not None and not self._put((key, batch)):
                return

    def _put(self, item: tuple[Hashable, Any] | _Failed) -> bool:
        while not self._stop.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> tuple[Hashable, Any]:
        item = self.ready.get()
        if isinstance(item, _Failed):
            self.ready.put(item)  # every later ask fails the same way
            raise item.error
        return item

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the thread: it finishes the batch it waits for (a worker's load), if any."""
        self._stop.set()
        with self.sampler.changed:
            self.sampler.changed.notify_all()
        self._thread.join(timeout_s)


class PlannedLoader:
    """One rank's DataLoader over its planned chunks (``loader.num_workers`` > 0)."""

    prefetches = True  # windows fed ahead are loaded ahead

    def __init__(
        self,
        source: BatchSource,
        cfg: LoaderConfig,
        collate: Collate,
        device: torch.device,
    ) -> None:
        self.source = source  # the permutation and the batch size
        self.cfg = cfg
        self.device = device
        self.sampler = PlanSampler()
        self._collate = PlanCollate(collate)
        self._fed: dict[Hashable, int] = {}  # window -> batches not consumed yet
        self._cancelled: set[Hashable] = set()
        self._iter: Any = None
        self._receiver: _Receiver | None = None
        self.loader = self._make(self.sampler) if cfg.persistent_workers else None

    def _make(self, batch_sampler: Any) -> DataLoader:
        pin = self.cfg.pin_memory
        pin_memory = self.device.type == "cuda" if pin == "auto" else bool(pin)
        return DataLoader(
            PlanDataset(self.source.dataset),
            batch_sampler=batch_sampler,
            num_workers=self.cfg.num_workers,
            collate_fn=self._collate,
            pin_memory=pin_memory and torch.cuda.is_available(),
            prefetch_factor=self.cfg.prefetch_factor,
            persistent_workers=self.cfg.persistent_workers,
        )

    def _index_batches(self, epoch: int, chunks: Sequence[tuple[int, int]]) -> list[list[int]]:
        perm = self.source.permutation(epoch)
        return [
            perm[p.start : p.stop].tolist() for p in chunk_batches(chunks, self.source.batch_size)
        ]

    def feed(self, key: Hashable, epoch: int, chunks: Sequence[tuple[int, int]]) -> None:
        """Plan ``key``'s batches (once); the workers start on them as slots free up."""
        if key in self._fed or not chunks or self.loader is None:
            return
        batches = self._index_batches(epoch, chunks)
        self._fed[key] = len(batches)
        self.sampler.put(key, batches)
        if self._iter is None:
            self._iter = iter(self.loader)  # starts the workers on what is planned so far
            self._receiver = _Receiver(self._iter, self.sampler)

    def cancel(self, key: Hashable) -> None:
        """``key`` will not be trained: drop its batches; those in flight are discarded."""
        left = self._fed.pop(key, 0)
        if left and self.sampler.drop(key) < left:
            self._cancelled.add(key)

    def batches(self, key: Hashable, epoch: int, chunks: Sequence[tuple[int, int]]) -> Iterator:
        """``key``'s batches in plan order, on the device."""
        if self.loader is None:  # persistent_workers=false: one DataLoader per window
            yield from self._one_shot(epoch, chunks)
            return
        self.feed(key, epoch, chunks)
        for left in range(count_batches(chunks, self.source.batch_size) - 1, -1, -1):
            batch = self._next_of(key)
            if left:
                self._fed[key] = left
            else:
                del self._fed[key]
            yield to_device(batch, self.device)

    def _next_of(self, key: Hashable) -> Any:
        """The next batch of ``key``; fillers and batches of windows that were fed but are
        not trained (cancelled, or skipped: windows run in the order they were fed) are
        discarded unseen."""
        assert self._receiver is not None  # fed before asked
        while True:
            owner, batch = self._receiver.get()
            if owner == key:
                return batch
            if owner not in self._cancelled:
                log.debug("window %s was fed but not trained: its batches are discarded", owner)
                self.cancel(owner)

    def _one_shot(self, epoch: int, chunks: Sequence[tuple[int, int]]) -> Iterator:
        loader = self._make(self._index_batches(epoch, chunks))
        for batch in loader:
            yield to_device(batch, self.device)

    def close(self) -> None:
        """Stop the receiver, then the worker processes (now, not whenever the iterator is
        collected)."""
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.stop()
        iterator, self._iter, self.loader = self._iter, None, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class InlinePath:
    """Batches gathered in the training thread: resident tensors, or ``num_workers=0``."""

    prefetches = False  # nothing to feed: the fast path pays no look at the inbox

    def __init__(self, source: BatchSource) -> None:
        self.source = source

    def feed(self, key: Hashable, epoch: int, chunks: Sequence[tuple[int, int]]) -> None:
        """Nothing to prefetch: the batch is cut when it is asked for."""

    def cancel(self, key: Hashable) -> None:
        """Nothing was loaded ahead."""

    def batches(self, key: Hashable, epoch: int, chunks: Sequence[tuple[int, int]]) -> Iterator:
        return self.source.batches(epoch, chunks)

    def close(self) -> None:
        """No workers to stop."""


def data_path(source: BatchSource, cfg: LoaderConfig) -> PlannedLoader | InlinePath:
    """Resident tensors and ``num_workers=0`` stay inline (no DataLoader per-batch overhead);
    anything else streams through a plan-fed DataLoader."""
    if source.fast or cfg.num_workers == 0:
        return InlinePath(source)
    return PlannedLoader(source, cfg, source.collate, source.device)


def collate_for(cfg: LoaderConfig, given: Collate | None) -> Collate:
    """The run's collate function: an adopted DataLoader's, ``loader.collate_fn``, or torch's."""
    if given is not None:
        return given
    if cfg.collate_fn is not None:
        from flodl.config import resolve_dotted

        return resolve_dotted(cfg.collate_fn)  # type: ignore[no-any-return]
    return default_collate


def eval_batches(source: BatchSource, cfg: LoaderConfig, start: int, stop: int) -> Iterator:
    """Samples ``[start, stop)`` of the eval set in order, ``loader.eval_batch_size`` at a time
    (workers, when the set is not resident and ``num_workers`` > 0; they end with the pass)."""
    size = cfg.eval_batch_size or max(source.batch_size, 256)
    if source.fast or cfg.num_workers == 0:
        yield from source.sequential(size, start, stop)
        return
    end = min(stop, len(source.dataset))
    plan = [list(range(i, min(i + size, end))) for i in range(start, end, size)]
    pin = (cfg.pin_memory == "auto" and source.device.type == "cuda") or cfg.pin_memory is True
    loader = DataLoader(
        source.dataset,
        batch_sampler=plan,
        num_workers=min(cfg.num_workers, len(plan)) if plan else 0,
        collate_fn=source.collate,
        pin_memory=pin and torch.cuda.is_available(),
    )
    for batch in loader:
        yield to_device(batch, source.device)


# -- launcher side: what the user passed to .dataset() ------------------------------------------
_ADOPTED = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")


def _refuse_loader(why: str) -> ConfigError:
    return ConfigError(
        f"dataset is a DataLoader {why}: flodl's controller plans which samples each rank "
        "loads, so it cannot adopt that; pass the dataset to .dataset(...) and the worker "
        "settings to .loader(num_workers=..., collate_fn=...)"
    )


def adopt(dataset: Any, loader: LoaderConfig, batch_size: int) -> tuple[Any, LoaderConfig, Any]:
    """``(dataset, loader settings, collate_fn)`` for what was passed to ``.dataset()``.

    A ``DataLoader`` is adopted, its dataset, collate function and worker settings (settings
    given to ``.loader(...)`` win), or refused when its order is its own (a custom sampler or
    batch sampler). An ``IterableDataset`` without shards is refused. Both before any rank."""
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            "dataset is an IterableDataset without shards: the controller plans which samples "
            f"each rank trains, so give a map-style dataset, or shards: {SHARD_API}"
        )
    if not isinstance(dataset, DataLoader):
        return dataset, loader, None
    if isinstance(dataset.dataset, IterableDataset):
        raise _refuse_loader("over an IterableDataset")
    batcher = dataset.batch_sampler
    if batcher is not None and type(batcher) is not BatchSampler:
        raise _refuse_loader(f"with its own batch_sampler ({type(batcher).__name__})")
    if type(dataset.sampler) not in (SequentialSampler, RandomSampler):
        raise _refuse_loader(f"with its own sampler ({type(dataset.sampler).__name__})")
    if dataset.batch_size is not None and dataset.batch_size != batch_size:
        log.warning(
            "the DataLoader's batch_size=%d is not adopted: each rank's batch is "
            "trainer.batch_size=%d (set .batch_size(%d) to keep it)",
            dataset.batch_size,
            batch_size,
            dataset.batch_size,
        )
    given = {k for k, v in loader.model_dump().items() if v != LoaderConfig.model_fields[k].default}
    workers = dataset.num_workers
    taken = {
        "num_workers": workers,
        "prefetch_factor": dataset.prefetch_factor if workers else None,
        "pin_memory": dataset.pin_memory or "auto",
        "persistent_workers": dataset.persistent_workers or loader.persistent_workers,
    }
    updates = {k: taken[k] for k in _ADOPTED if k not in given}
    collate = None if dataset.collate_fn is default_collate else dataset.collate_fn
    return dataset.dataset, loader.model_copy(update=updates), collate
