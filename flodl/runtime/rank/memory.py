"""``cluster.batch_sizes: auto``: the largest batch whose probe step fits in this rank's memory.

Runs on the rank, before training, on its own CUDA device (the launcher refuses ``auto`` for CPU
ranks). A probe step is one forward, backward and optimizer step of the rank's model (its weights
are restored afterwards) with a throwaway optimizer, in the run's precision; it fits when it
neither runs out of memory nor peaks above ``cluster.memory_fraction`` of the device's memory.
Sizes double from 1 while they fit, then the gap to the first misfit is bisected, so a size is
decided in about ``2 log2(size)`` probe steps.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

log = logging.getLogger(__name__)

_MAX_PROBE = 1 << 16


def _fits(worker: Any, dataset: Any, size: int, budget: float) -> bool:
    """One probe step on the rank's own model with a throwaway optimizer (its state counts)."""
    from flodl.data.source import BatchSource

    device, model = worker.device, worker.model
    optimizer = worker.spec.optim_factory(model.parameters())
    source = BatchSource(dataset, size, worker.cfg.seed, device)
    peak = math.inf
    try:
        torch.cuda.reset_peak_memory_stats(device)
        batch = next(iter(source.batches(0, ((0, size),))))
        with worker.runner.autocast():
            loss = worker.spec.train_step(model, batch)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError:
        pass
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        torch.cuda.empty_cache()
    return peak <= budget


def probe_batch_size(worker: Any, dataset: Any) -> int:
    """The largest batch size (<= the dataset) whose probe step fits under the memory budget."""
    device = worker.device
    if device.type != "cuda":
        raise RuntimeError(
            f"cluster.batch_sizes=auto: rank {worker.rank} runs on {device}, where no memory "
            "probe exists; give the sizes instead"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    budget = worker.cfg.cluster.memory_fraction * total
    saved = {k: v.detach().to("cpu", copy=True) for k, v in worker.model.state_dict().items()}
    try:
        return _search(worker, dataset, budget, total)
    finally:  # the probes stepped the model: put back the weights (and BatchNorm statistics)
        worker.model.load_state_dict(saved)


def _search(worker: Any, dataset: Any, budget: float, total: int) -> int:
    limit = min(len(dataset), _MAX_PROBE)
    good, bad = 0, None
    size = 1
    while size <= limit and _fits(worker, dataset, size, budget):
        good, size = size, size * 2
    if size <= limit:
        bad = size
    elif good < limit and _fits(worker, dataset, limit, budget):
        return limit
    else:
        bad = limit if good < limit else None
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if _fits(worker, dataset, mid, budget) else (good, mid)
    if good == 0:
        raise RuntimeError(
            f"cluster.batch_sizes=auto: rank {worker.rank} cannot fit even one sample under "
            f"memory_fraction={worker.cfg.cluster.memory_fraction} of {total / 2**30:.1f} GiB"
        )
    return good
