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
from dataclasses import dataclass
from typing import Any

import torch

from flodl.runtime.rank.setup import ModelParts
from flodl.runtime.wire.job_spec import JobSpec

log = logging.getLogger(__name__)

_MAX_PROBE = 1 << 16


@dataclass(frozen=True)
class BatchProbe:
    """What the probe reads of a rank: its job, identity, device and model."""

    spec: JobSpec
    rank: int
    device: torch.device
    parts: ModelParts

    def fits(self, dataset: Any, size: int, budget: float) -> bool:
        """One probe step on the rank's own model with a throwaway optimizer (its state
        counts)."""
        from flodl.data.source import BatchSource

        device, model = self.device, self.parts.model
        optimizer = self.spec.optim_factory(model.parameters())
        source = BatchSource(dataset, size, self.spec.config.seed, device)
        peak = math.inf
        try:
            torch.cuda.reset_peak_memory_stats(device)
            batch = next(iter(source.batches(0, ((0, size),))))
            with self.parts.runner.autocast():
                loss = self.spec.train_step(model, batch)
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


def probe_batch_size(probe: BatchProbe, dataset: Any) -> int:
    """The largest batch size (<= the dataset) whose probe step fits under the memory budget."""
    device = probe.device
    if device.type != "cuda":
        raise RuntimeError(
            f"cluster.batch_sizes=auto: rank {probe.rank} runs on {device}, where no memory "
            "probe exists; give the sizes instead"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    budget = probe.spec.config.cluster.memory_fraction * total
    model = probe.parts.model
    saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    try:
        return _search(probe, dataset, budget, total)
    finally:  # the probes stepped the model: put back the weights (and BatchNorm statistics)
        model.load_state_dict(saved)


def own_batch_size(probe: BatchProbe, dataset: Any) -> int:
    """This rank's batch size: the placement's (``None``: probed here); a memory plan may
    still halve it."""
    size = probe.spec.batch_size_for(probe.rank)
    if size is None:  # cluster.batch_sizes=auto: the largest that fits, probed here
        size = probe_batch_size(probe, dataset)
        log.info(
            "rank %d: batch size %d (probed, memory_fraction %.2f)",
            probe.rank,
            size,
            probe.spec.config.cluster.memory_fraction,
        )
    return int(size)


def _search(probe: BatchProbe, dataset: Any, budget: float, total: int) -> int:
    limit = min(len(dataset), _MAX_PROBE)
    good, bad = 0, None
    size = 1
    while size <= limit and probe.fits(dataset, size, budget):
        good, size = size, size * 2
    if size <= limit:
        bad = size
    elif good < limit and probe.fits(dataset, limit, budget):
        return limit
    else:
        bad = limit if good < limit else None
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if probe.fits(dataset, mid, budget) else (good, mid)
    if good == 0:
        raise RuntimeError(
            f"cluster.batch_sizes=auto: rank {probe.rank} cannot fit even one sample under "
            f"memory_fraction={probe.spec.config.cluster.memory_fraction} of "
            f"{total / 2**30:.1f} GiB"
        )
    return good
