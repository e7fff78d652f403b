"""Evaluation that is right for any metric: update per batch, merge shards, compute once.

Every eval quantity is a mergeable metric: the task's ``metrics`` (torchmetrics
:class:`~torchmetrics.Metric` objects), the eval loss and the legacy ``eval_fn`` (both a
:class:`SampleMean`: a value per chunk weighted by the chunk's size — right for the loss, and
for an ``eval_fn`` only when it returns a mean over samples, such as accuracy). torchmetrics is
imported only by the task's own metric factories: importing it costs more than torch itself.
A rank updates fresh metrics over its part of the eval set and sends their *states* to the
launcher, which merges the parts with torchmetrics' own reduction (``merge_state``) and
computes each metric once — so sharded and elected-rank evaluation give the same numbers,
whatever the eval chunk size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

EVAL_LOSS = "eval_loss"  # the name of the eval loss among the eval metrics

EvalStep = Callable[[nn.Module, Sequence[torch.Tensor]], tuple[Any, Any]]
Metric = Any  # a torchmetrics Metric, or anything with update / merge_state / compute / to


class SampleMean:
    """The mean over samples of per-chunk means, ``sum(value_i * n_i) / sum(n_i)`` (in float64
    on the host), mergeable like a torchmetrics metric."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, value: float | torch.Tensor, n: int) -> None:
        self.total += float(value) * n
        self.count += int(n)

    def merge_state(self, other: SampleMean) -> None:
        self.total += other.total
        self.count += other.count

    def compute(self) -> float:
        return self.total / self.count if self.count else math.nan

    def to(self, device: Any) -> SampleMean:
        return self

    def cpu(self) -> SampleMean:
        return self


def default_eval_step(model: nn.Module, batch: Sequence[torch.Tensor]) -> tuple[Any, Any]:
    """``(model(input), target)``: what every metric and the eval loss are updated with."""
    return model(batch[0]), batch[1]


@dataclass
class EvalSpec:
    """What one evaluation computes; travels to the ranks inside the job spec."""

    metrics: dict[str, Callable[[], Metric]] = field(default_factory=dict)
    eval_loss: Callable[[Any, Any], torch.Tensor] | None = None
    eval_step: EvalStep | None = None
    eval_fn: Callable[..., float] | None = None  # legacy: fn(model, input, target) -> chunk mean
    eval_fn_name: str = "eval"

    @property
    def enabled(self) -> bool:
        return bool(self.metrics) or self.eval_loss is not None or self.eval_fn is not None

    @property
    def names(self) -> list[str]:
        """Metric names in display order: the eval loss, the legacy eval_fn, then ``metrics``."""
        names = [EVAL_LOSS] if self.eval_loss is not None else []
        if self.eval_fn is not None:
            names.append(self.eval_fn_name)
        return names + [n for n in self.metrics if n not in names]

    def build(self, device: torch.device) -> dict[str, Metric]:
        """Fresh metrics on ``device`` (one set per evaluation)."""
        built: dict[str, Metric] = {}
        if self.eval_loss is not None:
            built[EVAL_LOSS] = SampleMean()
        if self.eval_fn is not None:
            built[self.eval_fn_name] = SampleMean()
        for name, factory in self.metrics.items():
            metric = factory()
            if not all(hasattr(metric, a) for a in ("update", "merge_state", "compute", "to")):
                raise TypeError(
                    f"task.metrics.{name}: must build a torchmetrics Metric, got "
                    f"{type(metric).__name__}"
                )
            built[name] = metric
        return {name: m.to(device) for name, m in built.items()}


def shard_range(n_samples: int, shard: int, shards: int) -> tuple[int, int]:
    """Contiguous ``[start, stop)`` of shard ``shard`` of ``shards``; sizes differ by at most 1."""
    return n_samples * shard // shards, n_samples * (shard + 1) // shards


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Iterable[Sequence[torch.Tensor]], spec: EvalSpec, device: Any
) -> dict[str, Metric]:
    """Update fresh metrics over ``batches`` (model in eval mode); return them on CPU."""
    metrics = spec.build(torch.device(device))
    step = spec.eval_step or default_eval_step
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            _update(metrics, spec, step, model, batch)
    finally:
        model.train(was_training)
    return {name: m.cpu() for name, m in metrics.items()}


def _update(
    metrics: dict[str, Metric], spec: EvalSpec, step: EvalStep, model: nn.Module, batch: Any
) -> None:
    from flodl.data.source import batch_samples

    n = batch_samples(batch) or 0
    if spec.eval_fn is not None:
        target = batch[1] if len(batch) > 1 else batch[0]
        metrics[spec.eval_fn_name].update(float(spec.eval_fn(model, batch[0], target)), n)
    if spec.eval_loss is None and not spec.metrics:
        return
    preds, target = step(model, batch)
    if spec.eval_loss is not None:
        metrics[EVAL_LOSS].update(float(spec.eval_loss(preds, target)), n)
    for name in spec.metrics:
        metrics[name].update(preds, target)


def merge(parts: Sequence[Mapping[str, Metric]]) -> dict[str, float]:
    """Merge the shards' metric states (torchmetrics' reduction) and compute every metric once."""
    if not parts:
        return {}
    merged = {name: m for name, m in parts[0].items()}
    for part in parts[1:]:
        for name, metric in part.items():
            merged[name].merge_state(metric)
    out: dict[str, float] = {}
    for name, metric in merged.items():
        _local_compute(metric)
        out.update(_values(name, metric.compute()))
    return out


def _local_compute(metric: Metric) -> None:
    """The states are merged already: compute must not all-gather. torchmetrics would, over the
    default process group, wherever one is initialised — and with torchrun or SLURM placement
    the controller shares rank 0's process, whose group is in use by its worker's averaging."""
    if hasattr(metric, "sync_on_compute"):
        metric.sync_on_compute = False
        metric._to_sync = False  # compute reads this copy of sync_on_compute


def _values(name: str, value: Any) -> dict[str, float]:
    """A metric's value as floats: a scalar by its name, a vector as ``name/i``."""
    tensor = torch.as_tensor(value, dtype=torch.float64).flatten()
    if tensor.numel() == 1:
        return {name: float(tensor[0])}
    return {f"{name}/{i}": float(v) for i, v in enumerate(tensor.tolist())}


def primary_name(names: Iterable[str], wanted: str | None) -> str | None:
    """The metric summaries call ``eval_value``: ``wanted`` when reported, else the first task
    metric, else the eval loss."""
    names = list(names)
    if wanted in names:
        return wanted
    return next((n for n in names if n != EVAL_LOSS), names[0] if names else None)
