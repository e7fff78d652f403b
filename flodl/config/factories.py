"""The builders a composed config's ``_target_`` references go through: model, optimizer,
dataset, scheduler, metric. Module-level, so they pickle by reference to the ranks; shared by the
Hydra job (:mod:`flodl.cli.app`) and the launcher-side checks (:mod:`flodl.preflight`)."""

from __future__ import annotations

from typing import Any

from flodl.config import TargetConfig, resolve_dotted


def instantiate(target: TargetConfig, *args: Any, **extra: Any) -> Any:
    """``target``'s object, built by Hydra with ``args`` and ``extra`` keyword arguments."""
    from hydra.utils import instantiate as hydra_instantiate

    return hydra_instantiate({"_target_": target.target, **target.kwargs(), **extra}, *args)


def build_model(target: TargetConfig, device: Any) -> Any:
    return instantiate(target).to(device)


def build_optimizer(target: TargetConfig, params: Any) -> Any:
    return instantiate(target, params)


def build_dataset(target: TargetConfig, split: str) -> Any:
    return instantiate(target, split=split)


def build_scheduler(target: TargetConfig, optimizer: Any, total_steps: int | None = None) -> Any:
    """``total_steps: auto`` (or left out where the target needs it) becomes the run's length."""
    from hydra.utils import instantiate as hydra_instantiate

    from flodl.step.schedules import fill_total_steps

    kwargs = fill_total_steps(resolve_dotted(target.target), target.kwargs(), total_steps)
    return hydra_instantiate({"_target_": target.target, **kwargs}, optimizer)


def build_metric(target: TargetConfig) -> Any:
    return instantiate(target)
