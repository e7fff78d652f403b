"""Dry builds: model, optimizer and scheduler built in the launcher as the ranks will build them.

On the ``meta`` device first (no memory, no data), on CPU when a constructor cannot run on
``meta`` (it computes with values); CUDA is never touched: a constructor that reaches for it
(``.cuda()``, ``device="cuda"``) is left to the ranks. A constructor's refusal on CPU is a
:class:`ConfigError` naming what failed and its innermost cause. Both kinds of factory go
through here: Hydra's ``_target_`` references (:func:`dry_build_targets`) and the Python API's
closures (:func:`dry_build_closures`). Either returns the model's architecture signature, which
the launcher compares with a resume bundle's.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from flodl.config import ConfigError, TargetConfig
from flodl.monitor.failures import describe

log = logging.getLogger("flodl")


class _NeedsCuda(Exception):
    """Raised in place of CUDA's initialisation during a dry build."""


# A factory builds the model for a device; the optimizer gets the model; a scheduler the optimizer.
Builders = tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[Any], Any] | None]


def dry_build_targets(
    model: TargetConfig, optimizer: TargetConfig, scheduler: TargetConfig | None
) -> str | None:
    """Build the ``_target_`` factories of a Hydra job; refusals name the config section."""
    from flodl.config import factories

    def fix(key: str, target: TargetConfig) -> tuple[str, str]:
        return f"{key}: {target.target}({_shown(target.kwargs())})", f"fix the {key}.* values"

    builders: Builders = (
        lambda _device: factories.instantiate(model),
        lambda model_: factories.build_optimizer(optimizer, model_.parameters()),
        None
        if scheduler is None  # total_steps: auto is the run's length, known on the ranks
        else lambda optim: factories.build_scheduler(scheduler, optim, total_steps=1000),
    )
    names = [fix("model", model), fix("optimizer", optimizer)]
    if scheduler is not None:
        names.append(fix("scheduler", scheduler))
    return _dry_build(builders, tuple(names), f"model._target_={model.target}")


def dry_build_closures(spec: Any) -> str | None:
    """Build the Python API's ``model_factory``, ``optim_factory`` and ``scheduler_factory``."""
    from flodl.step import schedules

    scheduler = spec.scheduler_factory
    builders: Builders = (
        spec.model_factory,
        lambda model_: spec.optim_factory(model_.parameters()),
        None if scheduler is None else lambda optim: schedules.build(scheduler, optim, 1000),
    )
    names = [
        (f"model_factory {_name(spec.model_factory)}", "fix the model factory"),
        (f"optim_factory {_name(spec.optim_factory)}", "fix the optimizer factory"),
    ]
    if scheduler is not None:
        names.append((f"scheduler_factory {_name(scheduler)}", "fix the scheduler factory"))
    return _dry_build(builders, tuple(names), f"model_factory {_name(spec.model_factory)}")


def _dry_build(builders: Builders, names: tuple[tuple[str, str], ...], what: str) -> str | None:
    import torch

    with _quiet(), without_dynamo_import(), _no_cuda():
        try:
            with torch.device("meta"):
                return _build_all(builders, names, torch.device("meta"), explain=False)
        except Exception as exc:  # some constructors cannot run on meta (they compute): CPU
            if _needs_cuda(exc):
                return _left_to_ranks(what)
        try:
            return _build_all(builders, names, torch.device("cpu"), explain=True)
        except Exception as exc:
            if _needs_cuda(exc):
                return _left_to_ranks(what)
            raise


def _left_to_ranks(what: str) -> str | None:
    """No signature: the ranks build it (and compare their architectures among themselves)."""
    log.debug("%s reaches for CUDA: not dry-built in the launcher, the ranks build it", what)
    return None


def _needs_cuda(exc: BaseException | None) -> bool:
    """Whether the build reached for CUDA (Hydra wraps the constructor's exception)."""
    return any(isinstance(e, _NeedsCuda) for e in _chain(exc))


def _build_all(
    builders: Builders, names: tuple[tuple[str, str], ...], device: Any, explain: bool
) -> str:
    from torch import nn

    from flodl.runtime.wire.job_spec import state_signature

    build_model, build_optimizer, build_scheduler = builders
    model = _refusal(names[0], lambda: build_model(device), explain)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{names[0][0]}: returned {type(model).__name__}, not an nn.Module")
    optimizer = _refusal(names[1], lambda: build_optimizer(model), explain)
    if build_scheduler is not None:
        _refusal(names[2], lambda: build_scheduler(optimizer), explain)
    shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in model.state_dict().items()]
    return state_signature(shapes)


def _refusal(name: tuple[str, str], build: Callable[[], Any], explain: bool) -> Any:
    try:
        return build()
    except Exception as exc:
        if not explain or _needs_cuda(exc):
            raise
        refusal = _config_error(exc)
        if refusal is not None:  # the factory's own refusal already names the key and the fix
            raise ConfigError(
                str(refusal)
            ) from None  # a new one: re-raising it would loop its chain
        what, fix = name
        raise ConfigError(f"{what} refused on a dry build: {describe(exc)}; {fix}") from exc


def _config_error(exc: BaseException | None) -> ConfigError | None:
    """A :class:`ConfigError` the factory raised (Hydra wraps it in its own exception)."""
    return next((e for e in _chain(exc) if isinstance(e, ConfigError)), None)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and its causes, innermost last, each once (a chain may loop back on itself)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _name(fn: Any) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def _shown(kwargs: dict[str, Any]) -> str:
    import json

    return ", ".join(
        f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in kwargs.items()
    )


@contextlib.contextmanager
def _no_cuda() -> Iterator[None]:
    """CUDA initialises through ``torch.cuda._lazy_init`` (tensors, ``.cuda()``, streams): in its
    place, an exception that ends the dry build, so the launcher never holds a CUDA context."""
    import torch

    if torch.cuda.is_initialized():  # nothing left to protect
        yield
        return

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise _NeedsCuda

    saved = torch.cuda._lazy_init
    torch.cuda._lazy_init = refuse
    try:
        yield
    finally:
        torch.cuda._lazy_init = saved


@contextlib.contextmanager
def without_dynamo_import() -> Iterator[None]:
    """``Optimizer.__init__`` imports ``torch._dynamo`` on its first call (1-2 s, more on a busy
    machine) only to exclude ``add_param_group`` from compilation; a dry build compiles nothing.
    torch's lazy wrapper caches the excluded function as ``__dynamo_disable``: seed that cache
    with the plain function during the dry build, then remove it again."""
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
