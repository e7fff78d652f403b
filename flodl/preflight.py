"""Everything checkable is checked in the launcher, before any rank starts (exit code 2).

Two halves. :func:`check_factories` (Hydra jobs: ``_target_`` references) binds each factory's
keyword arguments against the target's signature and annotations (unknown, misspelt, wrong type),
then *dry-builds* the model, optimizer and scheduler on the ``meta`` device (CPU when the model
cannot be built on ``meta``; CUDA is never touched), and compares the batch size with the
dataset's length where the dataset factory can tell it cheaply (a ``num_samples`` attribute: a
function of the same arguments that does not load the data). :func:`check_run` (every run, the
Python API included) checks what needs the topology: the callback rank, the resume bundle and a
writable ``save_path``.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import io
import json
import logging
import typing
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from flodl.config import ConfigError, TargetConfig, TrainerConfig, resolve_dotted
from flodl.failures import describe

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
    return dry_build(run_cfg.model, run_cfg.optimizer, run_cfg.scheduler)


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
        from flodl.data import SHARD_API

        raise ConfigError(
            f"dataset._target_={target.target}: an IterableDataset without shards; the "
            f"controller plans which samples each rank trains: give a map-style dataset or "
            f"{SHARD_API}"
        )


def _target(key: str, target: TargetConfig) -> Callable[..., Any]:
    fn = resolve_dotted(target.target)
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
            continue  # flodl fills in the run's length (flodl/schedules.py)
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


def dry_build(model: TargetConfig, optimizer: TargetConfig, scheduler: TargetConfig | None) -> str:
    """Build model, optimizer and scheduler as the ranks will, on ``meta`` (else CPU); return the
    architecture signature. A constructor's refusal becomes a :class:`ConfigError`."""
    import torch

    with _quiet(), _without_dynamo_import():
        try:
            with torch.device("meta"):
                return _build_all(model, optimizer, scheduler, explain=False)
        except Exception:  # some constructors cannot run on meta (they compute with values): CPU
            return _build_all(model, optimizer, scheduler, explain=True)


@contextlib.contextmanager
def _without_dynamo_import() -> Iterator[None]:
    """``Optimizer.__init__`` imports ``torch._dynamo`` on its first call (1-2 s, more on a busy
    machine) only to exclude ``add_param_group`` from compilation; a dry build compiles nothing.
    torch's lazy wrapper caches the excluded function as ``__dynamo_disable``: seed that cache
    with the plain function during the dry build, then remove it again."""
    import sys

    import torch

    seeded = []
    if "torch._dynamo" not in sys.modules:
        for name in ("add_param_group", "state_dict", "load_state_dict", "zero_grad"):
            raw = getattr(getattr(torch.optim.Optimizer, name, None), "__wrapped__", None)
            if raw is not None and not hasattr(raw, "__dynamo_disable"):
                raw.__dynamo_disable = raw
                seeded.append(raw)
    try:
        yield
    finally:
        for raw in seeded:
            del raw.__dynamo_disable


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """What the constructors print, log or warn is the ranks' to say (they build for real): a
    dry build in the launcher would only say it twice."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _build_all(
    model: TargetConfig, optimizer: TargetConfig, scheduler: TargetConfig | None, explain: bool
) -> str:
    from flodl import factories as app
    from flodl.runtime.spec import state_signature

    built = _refusal("model", model, lambda: app.instantiate(model), explain)
    if not hasattr(built, "parameters") or not hasattr(built, "state_dict"):
        raise ConfigError(
            f"model._target_={model.target}: returned {type(built).__name__}, not an nn.Module"
        )
    params = built.parameters()
    optim = _refusal(
        "optimizer", optimizer, lambda: app.build_optimizer(optimizer, params), explain
    )
    if scheduler is not None:
        # total_steps: auto is the run's length, known on the ranks: any length builds here
        build = lambda: app.build_scheduler(scheduler, optim, total_steps=1000)  # noqa: E731
        _refusal("scheduler", scheduler, build, explain)
    shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in built.state_dict().items()]
    return state_signature(shapes)


def _refusal(key: str, target: TargetConfig, build: Callable[[], Any], explain: bool) -> Any:
    try:
        return build()
    except Exception as exc:
        if not explain:
            raise
        raise ConfigError(
            f"{key}: {target.target}({_shown(target.kwargs())}) refused on a dry build: "
            f"{describe(exc)}; fix the {key}.* values"
        ) from exc


def _check_batch_size(dataset: TargetConfig, batch_size: int) -> None:
    length = getattr(resolve_dotted(dataset.target), "num_samples", None)
    if not callable(length):
        return
    try:
        n = int(length(split="train", **dataset.kwargs()))
    except Exception:
        return  # the dataset factory will say what is wrong, on the ranks
    if batch_size > n:
        raise ConfigError(
            f"trainer.batch_size={batch_size}: larger than the dataset ({n} training samples "
            f"of {dataset.target}); use at most {n}"
        )


# -- what needs the topology ------------------------------------------------------------------
def check_run(cfg: TrainerConfig, world_size: int, signature: str | None = None) -> Any:
    """Callback rank, save location and resume bundle; returns the loaded resume point."""
    policy = cfg.callback_policy
    if policy.kind == "rank" and policy.rank >= world_size:
        raise ConfigError(
            f"trainer.callback_policy.rank={policy.rank}: this run has {world_size} rank(s) "
            f"(0..{world_size - 1}); pick one of them or callback_policy.kind=fastest"
        )
    if cfg.save_path is not None:
        from flodl.checkpoint import CheckpointError, probe_writable

        try:
            probe_writable(cfg.save_path)
        except CheckpointError as exc:
            raise ConfigError(
                f"trainer.save_path={cfg.save_path}: {exc}; choose a writable location"
            ) from None
    return _resume(cfg, world_size, signature) if cfg.resume_from is not None else None


def _resume(cfg: TrainerConfig, world_size: int, signature: str | None) -> Any:
    from flodl.checkpoint import CheckpointError
    from flodl.runtime.snapshots import ResumePoint

    stem = cfg.resume_from
    assert stem is not None
    key = f"trainer.resume_from={stem}"
    try:
        point = ResumePoint.load(stem, fallback=cfg.resume_fallback)
    except CheckpointError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    meta = point.meta
    if meta.world_size != world_size:  # any world size resumes (README: Checkpoints)
        logging.getLogger(__name__).info(
            "%s: saved by %d ranks, resuming on %d", key, meta.world_size, world_size
        )
    if signature is not None and meta.signature and meta.signature != signature:
        raise ConfigError(
            f"{key}: saved for another model (architecture {meta.signature} != {signature}); "
            "point it at a bundle of this model"
        )
    if meta.epoch >= cfg.num_epochs:
        raise ConfigError(
            f"{key}: the bundle already finished {meta.epoch} epochs; trainer.num_epochs="
            f"{cfg.num_epochs} leaves nothing to train (raise it)"
        )
    return point
