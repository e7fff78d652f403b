"""Placement: is a rank's dataset resident on its device, or streamed batch by batch?

``resident`` collates the whole dataset once and keeps it on the device (a ``TensorDataset`` is
that already: on CPU it costs nothing, on CUDA one copy); each batch is then an index gather
there. ``streaming`` loads batch by batch (DataLoader workers, pinned memory, async copies).
``auto`` decides per rank: resident when the dataset is tensors that fit
``loader.resident_fraction`` of the device's free memory, else streaming. An explicit
``resident`` on another dataset calls ``__getitem__`` once per sample, up front: per-access
randomness (augmentation) is then fixed for the run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.utils.data import TensorDataset

from flodl.config import LoaderConfig
from flodl.data.source import BatchSource, fetch, tree_map

log = logging.getLogger(__name__)

_MIB = 1 << 20


def free_bytes(device: torch.device) -> int:
    """Free memory of ``device``: CUDA's free bytes, else the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def tree_bytes(tree: Any) -> int:
    sizes: list[int] = []
    tree_map(lambda t: sizes.append(t.numel() * t.element_size()), tree)
    return sum(sizes)


def _concat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return type(first)((k, _concat([p[k] for p in parts])) for k in first)
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))
    raise TypeError(
        f"loader.placement=resident: a collated batch holds {type(first).__name__}, which "
        "cannot be kept on the device; use loader.placement=streaming"
    )


def materialize(source: BatchSource, step: int = 1024) -> Any:
    """The whole dataset collated into one tree of tensors (on CPU)."""
    n = len(source.dataset)
    parts = [
        fetch(source.dataset, range(i, min(i + step, n)), source.collate) for i in range(0, n, step)
    ]
    return _concat(parts)


def place(source: BatchSource, cfg: LoaderConfig) -> bool:
    """Make ``source`` resident when its placement says so; True when it is."""
    device, dataset = source.device, source.dataset
    tensors = list(dataset.tensors) if isinstance(dataset, TensorDataset) else None
    if cfg.placement == "streaming" or (cfg.placement == "auto" and tensors is None):
        if cfg.num_workers > 0:
            source.resident(None)  # workers load sample by sample
        return False
    if tensors is not None and device.type == "cpu":
        return True  # already in this process's memory: the fast path as it is
    budget = int(free_bytes(device) * cfg.resident_fraction)
    need = tree_bytes(tensors) if tensors is not None else None
    if need is not None and need > budget:
        return _too_big(source, cfg, need, budget)
    tree = tensors if tensors is not None else materialize(source)
    need = tree_bytes(tree)
    if need > budget:
        return _too_big(source, cfg, need, budget)
    source.resident(tree_map(lambda t: t.to(device), tree))
    log.info(
        "dataset resident on %s (%.1f MiB of a %.1f MiB budget)", device, need / _MIB, budget / _MIB
    )
    return True


def _too_big(source: BatchSource, cfg: LoaderConfig, need: int, budget: int) -> bool:
    if cfg.placement == "resident":
        raise ValueError(
            f"loader.placement=resident: the dataset needs {need / _MIB:.1f} MiB but "
            f"loader.resident_fraction={cfg.resident_fraction} of {source.device}'s free memory "
            f"is {budget / _MIB:.1f} MiB; raise resident_fraction or use placement=streaming"
        )
    if cfg.num_workers > 0:
        source.resident(None)
    return False
