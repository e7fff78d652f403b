"""A Hydra job's ``_target_`` references, checked in the launcher before any rank (exit code 2).

:func:`check_factories` resolves each factory's target (naming its key when it is not there),
binds its keyword arguments against the target's signature and annotations (unknown, misspelt,
wrong type), compares the batch size with the dataset's length where the dataset factory can
tell it cheaply (a ``num_samples`` attribute: a function of the same arguments that does not
load the data), then dry-builds model, optimizer and scheduler (:mod:`.dry_build`).
:func:`check_task_targets` resolves the task's dotted paths last: its metrics' package
(torchmetrics) is read rather than imported when its source shows the name, and imported in the
background (no other refusal needs it).
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import re
import sys
import threading
import typing
from collections.abc import Callable
from typing import Any

from flodl.config import ConfigError, TargetConfig, TaskConfig, defined_in_source, resolve_dotted
from flodl.preflight.dry_build import dry_build_targets

log = logging.getLogger(__name__)

_EMPTY = inspect.Parameter.empty


# -- factories: signature, annotations, dry build ------------------------------------------------
def check_factories(run_cfg: Any) -> str | None:
    """Check the model/optimizer/scheduler/dataset references of a :class:`RunConfig`; return
    the model's architecture signature (to compare with a resume bundle)."""
    bind("model", run_cfg.model, positional=0)
    bind("optimizer", run_cfg.optimizer, positional=1)
    if run_cfg.scheduler is not None:
        bind("scheduler", run_cfg.scheduler, positional=1)
    bind("dataset", run_cfg.dataset, positional=0, provided=("split",))
    _check_batch_size(run_cfg.dataset, run_cfg.trainer.batch_size)
    _check_dataset_kind(run_cfg.dataset)
    return dry_build_targets(run_cfg.model, run_cfg.optimizer, run_cfg.scheduler)


def _check_dataset_kind(target: TargetConfig) -> None:
    """A dataset target that builds a DataLoader or an IterableDataset (by its class or its
    return annotation) is refused here, before any rank: the ranks would refuse it later."""
    from torch.utils.data import DataLoader, IterableDataset

    fn = resolve_dotted(target.target)
    made = fn if isinstance(fn, type) else _hints(fn).get("return")
    if not isinstance(made, type):
        return
    if issubclass(made, DataLoader):
        raise ConfigError(
            f"dataset._target_={target.target}: builds a DataLoader; point it at the dataset "
            "and set the loader node (loader.num_workers, loader.collate_fn: the .loader(...) "
            "knobs)"
        )
    if issubclass(made, IterableDataset):
        from flodl.data.source import SHARD_API

        raise ConfigError(
            f"dataset._target_={target.target}: an IterableDataset without shards; the "
            f"controller plans which samples each rank trains: give a map-style dataset or "
            f"{SHARD_API}"
        )


def check_task_targets(task: TaskConfig) -> list[str]:
    """Resolve the task's step, eval and callback paths and its metrics' targets; return the
    metric targets found in their module's source instead, imported in the background.

    A metric's package not yet imported (torchmetrics: ~1.3 s with scipy, in the launcher's path
    to its ranks' first step) is read, not imported, when its source defines the name
    (:func:`~flodl.config.defined_in_source`); a daemon thread imports it meanwhile, so the
    launcher's first eval finds it imported (or waits on the import lock for it). A name the
    source does not show is imported here, and its error names the key, as before."""
    fields = ("train_step", "eval_fn", "eval_loss", "eval_step")
    for field in (*fields, "metrics_fn", "eval_result_fn", "epoch_fn"):
        path = getattr(task, field)
        if path is not None:
            resolve(f"task.{field}", path)
    deferred = []
    for name, metric in task.metrics.items():
        if metric.target.rpartition(".")[0] not in sys.modules and defined_in_source(metric.target):
            deferred.append(metric.target)
        else:
            _target(f"task.metrics.{name}", metric)
    if deferred:
        threading.Thread(
            target=_import_all, args=(deferred,), name="flodl-metric-import", daemon=True
        ).start()
    return deferred


def _import_all(paths: list[str]) -> None:
    for path in paths:
        try:
            resolve_dotted(path)
        except Exception as exc:  # its ranks' first eval refuses it, naming the metric
            log.warning("cannot import the metric %s: %s", path, exc)


def resolve(key: str, path: str) -> Any:
    """Import a dotted path; a :class:`ConfigError` naming the key when it is not there."""
    try:
        return resolve_dotted(path)
    except ValueError as exc:
        raise ConfigError(f"{key}={path}: {exc}; check the spelling") from None


def _target(key: str, target: TargetConfig) -> Callable[..., Any]:
    fn = resolve(f"{key}._target_", target.target)
    if not callable(fn):
        raise ConfigError(f"{key}._target_={target.target}: not callable")
    return fn


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return None


def bind(key: str, target: TargetConfig, positional: int, provided: tuple[str, ...] = ()) -> None:
    """Bind the config's keyword arguments (plus ``positional`` placeholders) to the target."""
    fn = _target(key, target)
    sig = _signature(fn)
    if sig is None:
        return
    kwargs = {k: v for k, v in target.kwargs().items() if not k.startswith("_")}
    positional += len(target.kwargs().get("_args_") or [])  # Hydra's positional arguments
    params = sig.parameters
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not open_kwargs:
        for name in kwargs:
            if name not in params or params[name].kind is params[name].POSITIONAL_ONLY:
                close = difflib.get_close_matches(name, named, n=1)
                hint = f" (did you mean {key}.{close[0]}?)" if close else ""
                raise ConfigError(
                    f"{key}.{name}: unknown argument of {target.target}{hint}; it takes: "
                    f"{', '.join(named) or 'no keyword arguments'}"
                )
    filled = {**{p: None for p in provided}, **kwargs}
    try:
        sig.bind(*([None] * positional), **filled)
    except TypeError as exc:
        raise ConfigError(
            f"{key}: {target.target} cannot be called with {_shown(kwargs)}: {exc}"
        ) from None
    hints = _hints(fn)
    for name, value in kwargs.items():
        if key == "scheduler" and name == "total_steps" and value == "auto":
            continue  # flodl fills in the run's length (flodl/step/schedules.py)
        if name in params:
            _check_type(key, name, value, hints.get(name, params[name].annotation), target.target)


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # forward references the module cannot resolve: use the raw annotations
        return {}


def _check_type(key: str, name: str, value: Any, annotation: Any, target: str) -> None:
    """Refuse a value none of the annotation's pydantic-checkable alternatives accepts."""
    if annotation is _EMPTY or annotation is Any or isinstance(annotation, str) or value is None:
        return
    if _instantiated(value):  # Hydra builds `_target_` nodes first: the built object is passed
        return
    import torch
    from pydantic import TypeAdapter

    options = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    # A tensor never comes from a config file: ``Union[float, Tensor]`` (torch's lr) is a float.
    options = tuple(o for o in options if o is not torch.Tensor) or options
    adapters = []
    for option in options:
        try:
            adapters.append(TypeAdapter(option))
        except Exception:  # a type pydantic cannot check (a tensor, a dtype): not ours to judge
            return
    for adapter in adapters:
        try:
            adapter.validate_python(value)
            return
        except Exception:
            continue
    wanted = " or ".join(_type_name(o) for o in options)
    raise ConfigError(
        f"{key}.{name}={_value(value)}: {target} expects {wanted}; give a value of that type"
    )


def _instantiated(value: Any) -> bool:
    if isinstance(value, dict):
        return "_target_" in value or any(_instantiated(v) for v in value.values())
    if isinstance(value, list):
        return any(_instantiated(v) for v in value)
    return False


def _is_union(annotation: Any) -> bool:
    import types

    origin = typing.get_origin(annotation)
    return origin is typing.Union or origin is types.UnionType


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def _shown(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in kwargs.items()) or "no arguments"


def _check_batch_size(dataset: TargetConfig, batch_size: int) -> None:
    length = getattr(resolve("dataset._target_", dataset.target), "num_samples", None)
    if not callable(length):
        return
    try:
        n = int(length(split="train", **dataset.kwargs()))
    except ValueError as exc:  # the length names the argument: blame it, not the batch size
        named = re.match(r"[A-Za-z_]\w*=", str(exc)) is not None
        message = f"dataset.{exc}" if named else f"dataset ({dataset.target}): {exc}"
        raise ConfigError(message) from None
    except Exception:
        return  # the dataset factory will say what is wrong, on the ranks
    if n < 1:
        raise ConfigError(
            f"dataset ({dataset.target}, {_shown(dataset.kwargs())}): no training samples; "
            "give it at least one"
        )
    if batch_size > n:
        raise ConfigError(
            f"trainer.batch_size={batch_size}: larger than the dataset ({n} training samples "
            f"of {dataset.target}); use at most {n}"
        )
