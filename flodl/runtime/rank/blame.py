"""Whose fault a rank's exception is: the user's code, the run's non-finite policy, or neither.

A rank that dies, goes silent or is OOM-killed is a *membership* event: the survivors regroup.
An exception raised by the user's code (train step, eval step and metrics, the dataset while
batches are drawn) is not: it is deterministic and would happen on every rank in turn, so the
job fails with it (``trainer.on_rank_error: fail``, the default; ``drop`` loses the rank as a
lost device instead). The rank tags such an exception where it calls the user's code
(:func:`user_code`); :func:`classify` reads the tag when the rank reports its failure, with the
last frame of the traceback that is the user's (``file:line``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sysconfig
import traceback
from collections.abc import Iterator
from pathlib import Path

USER = "user"  # raised by the user's code
NONFINITE = "nonfinite"  # NaN/inf beyond trainer.max_nonfinite, or non-finite weights
_TAG = "__flodl_blame__"

_FLODL = Path(__file__).resolve().parents[2]  # the flodl package
# recipes are code configs point at: the user's side (the repository's recipes/, shipped as
# flodl.recipes; found, not imported)
_RECIPES = Path(str(getattr(importlib.util.find_spec("flodl.recipes"), "origin", ""))).parent
_LIBRARIES = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


class NonFiniteError(FloatingPointError):
    """NaN/inf losses or gradients past ``trainer.max_nonfinite``, or non-finite weights."""


def _device_failure(exc: BaseException) -> bool:
    """Failures of the device or the process around the user's code, not of the code: a CUDA
    out-of-memory error (a smaller device of an unequal rig) or a loader worker killed."""
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is always there on a rank
        pass
    return "DataLoader worker" in str(exc) and "killed" in str(exc)


@contextlib.contextmanager
def user_code(hook: str) -> Iterator[None]:
    """Tag an exception raised in ``hook`` (the user's train step, eval, dataset) as the user's."""
    try:
        yield
    except Exception as exc:
        if not _device_failure(exc) and not hasattr(exc, _TAG):
            setattr(exc, _TAG, f"{USER}:{hook}")
        raise


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def classify(exc: BaseException) -> tuple[str, str]:
    """``(blame, where)``: ``USER``, ``NONFINITE`` or ``""`` (a membership event), and for the
    user's exceptions the last frame of the traceback in the user's code (``file:line``)."""
    for link in _chain(exc):
        if isinstance(link, NonFiniteError):
            return NONFINITE, ""
        tag = getattr(link, _TAG, None)
        if isinstance(tag, str) and tag.startswith(USER):
            return USER, user_frame(link)
    return "", ""


def _is_library(filename: str) -> bool:
    path = str(Path(filename).resolve())
    inside_flodl = path.startswith(str(_FLODL) + os.sep) and not path.startswith(
        str(_RECIPES) + os.sep
    )
    return inside_flodl or path.startswith(_LIBRARIES) or filename.startswith("<")


def user_frame(exc: BaseException) -> str:
    """``file:line in function`` of the last frame outside flodl's runtime and the installed
    libraries (the innermost frame of the traceback when there is none)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    chosen = next((f for f in reversed(frames) if not _is_library(f.filename)), frames[-1])
    name = chosen.filename
    with contextlib.suppress(ValueError):
        name = os.path.relpath(name) if not os.path.relpath(name).startswith("..") else name
    return f"{name}:{chosen.lineno} in {chosen.name}"


__all__ = ["NONFINITE", "USER", "NonFiniteError", "classify", "user_code", "user_frame"]
