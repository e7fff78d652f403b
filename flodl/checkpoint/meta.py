"""A bundle's meta (``<stem>.meta.json``): its schema, what it records, and what a payload
may hold.
"""

from __future__ import annotations

import io
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

log = logging.getLogger(__name__)


SCHEMA_VERSION = 1


#: Schema versions this flodl reads: 1 (one ``.pt``, :func:`save_bundle`), 2 (sharded bundles
#: written by the runtime, :mod:`flodl.checkpoint.shards`).
READABLE_SCHEMAS = (1, 2)


#: A meta.json larger than this is not a meta.json (guards against reading a huge wrong file).
MAX_META_BYTES = 64 << 20


class CheckpointError(RuntimeError):
    """A bundle cannot be saved, found, trusted or used; the message says which file and why."""


@dataclass
class BundleMeta:
    """What a resumed run needs besides the tensors; serialised as ``<stem>.meta.json``.

    ``source`` is not serialised: :func:`load_bundle` / :func:`save_bundle` set it to the stem,
    so messages can name the bundle.
    """

    schema_version: int
    epoch: int  # completed epochs (resume starts at this epoch)
    global_step: int  # total cohort batches trained so far
    sync_round: int  # averaging windows completed
    world_size: int
    save_reason: str  # "checkpoint" | "graceful" | "max_failure" | "single_survivor" | "final"
    elche_state: dict[str, Any] | None  # ElCheState.to_dict()
    coverage: dict[str, Any]  # {"epoch", "n_samples", "uncovered": [[offset, size], ...]}
    config_hash: str
    signature: str  # model architecture fingerprint, see model_signature()
    saved_at: float  # time.time()
    pt_sha256: str = ""  # filled by save_bundle
    pt_bytes: int = 0  # filled by save_bundle
    flodl_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    shards: dict[str, Any] = field(default_factory=dict)  # schema 2: name -> {file, bytes, sha256}
    source: str = field(default="", compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of JSON types (``source`` left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _SERIALISED}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "") -> BundleMeta:
        """Parse and validate a dict written by :meth:`to_dict`; :class:`CheckpointError` if bad.

        An unknown ``schema_version`` is refused; unknown keys are ignored.
        """
        where = f"checkpoint meta {source}" if source else "checkpoint meta"
        if not isinstance(d, Mapping):
            raise CheckpointError(f"{where} is not a JSON object (got {type(d).__name__})")
        version = d.get("schema_version")
        if not _is_int(version):
            raise CheckpointError(f"{where} has no integer schema_version (got {version!r})")
        if version not in READABLE_SCHEMAS:
            raise CheckpointError(
                f"{where} has schema_version {version}, this flodl reads 1 or 2: "
                "resume with the flodl version that wrote it, or start fresh"
            )
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise CheckpointError(f"{where} lacks required keys {missing}")
        values: dict[str, Any] = {}
        for name in _SERIALISED:
            if name in d:
                values[name] = _FIELD_CHECKS[name](where, name, d[name])
        return cls(**values, source=source)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(where: str, name: str, v: Any) -> int:
    if not _is_int(v) or v < 0:
        raise CheckpointError(f"{where}: {name} must be a non-negative integer, got {v!r}")
    return int(v)


def _text(where: str, name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise CheckpointError(f"{where}: {name} must be a string, got {v!r}")
    return v


def _time(where: str, name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise CheckpointError(f"{where}: {name} must be a finite number, got {v!r}")
    return float(v)


def _obj(where: str, name: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise CheckpointError(f"{where}: {name} must be an object, got {type(v).__name__}")
    return v


def _obj_or_none(where: str, name: str, v: Any) -> dict[str, Any] | None:
    return None if v is None else _obj(where, name, v)


def _coverage(where: str, name: str, v: Any) -> dict[str, Any]:
    cov = _obj(where, name, v)
    for key in ("epoch", "n_samples"):
        if key in cov:
            _count(where, f"{name}.{key}", cov[key])
    ranges = cov.get("uncovered", [])
    ok = isinstance(ranges, list) and all(
        isinstance(r, (list, tuple)) and len(r) == 2 and all(_is_int(x) and x >= 0 for x in r)
        for r in ranges
    )
    if not ok:
        raise CheckpointError(
            f"{where}: {name}.uncovered must be a list of [offset, size] integer pairs"
        )
    return cov


def _sha(where: str, name: str, v: Any) -> str:
    s = _text(where, name, v)
    if s and not re.fullmatch(r"[0-9a-f]{64}", s):
        raise CheckpointError(f"{where}: {name} must be a hex sha256, got {s!r}")
    return s


def _world(where: str, name: str, v: Any) -> int:
    n = _count(where, name, v)
    if n < 1:
        raise CheckpointError(f"{where}: {name} must be at least 1, got {n}")
    return n


_FIELD_CHECKS: dict[str, Callable[[str, str, Any], Any]] = {
    "schema_version": _count,
    "epoch": _count,
    "global_step": _count,
    "sync_round": _count,
    "world_size": _world,
    "save_reason": _text,
    "elche_state": _obj_or_none,
    "coverage": _coverage,
    "config_hash": _text,
    "signature": _text,
    "saved_at": _time,
    "pt_sha256": _sha,
    "pt_bytes": _count,
    "flodl_version": _text,
    "extra": _obj,
    "shards": _obj,
}


_SERIALISED = tuple(_FIELD_CHECKS)


_REQUIRED = tuple(
    f.name
    for f in fields(BundleMeta)
    if f.name in _FIELD_CHECKS
    and f.name not in {"pt_sha256", "pt_bytes", "flodl_version", "extra", "shards"}
)


_LEAVES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


def check_payload(obj: Any, where: str, stem: str, depth: int = 0) -> None:
    """Refuse, at save time, anything ``torch.load(weights_only=True)`` would refuse at resume."""
    t = type(obj)
    if t in _LEAVES or isinstance(obj, torch.Tensor):
        return
    if depth > 64:
        raise CheckpointError(f"cannot save checkpoint {stem}.pt: payload{where} nests too deep")
    if t is dict or t is OrderedDict:
        for k, v in obj.items():
            if type(k) not in _LEAVES and type(k) is not tuple:
                _refuse(stem, f"{where} has a key of type {_tname(k)}")
            check_payload(v, f"{where}[{k!r}]", stem, depth + 1)
        return
    if t is list or t is tuple:
        for i, v in enumerate(obj):
            check_payload(v, f"{where}[{i}]", stem, depth + 1)
        return
    # Not on the list: accept it if this torch's safe unpickler does (newer torch allows more).
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:
        _refuse(stem, f"{where} is a {_tname(obj)}")


def _tname(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _refuse(stem: str, what: str) -> None:
    raise CheckpointError(
        f"cannot save checkpoint {stem}.pt: payload{what}; a bundle holds only tensors, dicts, "
        "lists, tuples, numbers, strings and None (convert it, e.g. torch.as_tensor(x) or "
        "float(x))"
    )


def installed_version() -> str:
    try:
        from importlib.metadata import version

        return version("flodl")
    except Exception:
        return ""
