"""Checkpoint bundles: ``<stem>.pt`` + ``<stem>.meta.json`` on any fsspec filesystem, atomically.

This module holds the meta (:class:`BundleMeta`), the single-file bundle (schema 1,
:func:`save_bundle`) and :func:`load_bundle`, which also reads the sharded bundles (schema 2)
that training runs write: each rank its own shard, the meta last (:mod:`flodl.checkpoint.shards`).

A *stem* is a local path or any fsspec URL without extension (``ckpt/run1``, ``file:///x/run1``,
``memory://ck/run1``, ``s3://bucket/run1`` when s3fs is installed); a trailing ``.pt`` or
``.meta.json`` is tolerated and dropped. A bundle is two files:

* ``<stem>.pt``: ``torch.save`` of the payload dict. Resume loads it with
  ``torch.load(weights_only=True)``, so the payload may only hold tensors, dicts (including
  ``OrderedDict``), lists, tuples, numbers, strings, bytes, ``None``, ``torch.Size`` /
  ``dtype`` / ``device``; anything else (a NumPy array or scalar, an arbitrary object) is refused
  by :func:`save_bundle` with the key path of the offending value, never discovered at resume.
* ``<stem>.meta.json``: :class:`BundleMeta` as JSON, including the ``sha256`` and size of the
  ``.pt`` it belongs to. Pairs are matched by that hash, not by file name.

Atomicity (a save may be SIGKILLed at any instant, or fail on a full disk):

1. serialise the payload to bytes in memory; hash it;
2. write ``<stem>.pt.tmp-<r>`` then ``<stem>.meta.json.tmp-<r>`` (fsync'd on local disks, plus
   the directory): from here on a complete new pair exists under temporary names;
3. park the current pair as ``<stem>.prev.pt`` / ``<stem>.prev.meta.json``;
4. move the temporary pair into place (``os.replace`` locally, ``fs.mv`` elsewhere);
5. delete the parked pair and any stale temporaries left by earlier interrupted saves.

The old pair is never touched before the new pair is complete, and :func:`load_bundle` looks at
every candidate (the current names, ``.prev``, temporaries), keeps the metas that parse and whose
``.pt`` has the recorded size and sha256, and loads the newest by
``(epoch, global_step, sync_round, saved_at)``. So after a crash at any point the newest
*committed* bundle is loadable, a bundle whose ``save_bundle`` returned is never lost to a later
interrupted save, and a torn file is recognised instead of loaded. One saver per stem at a time.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from flodl.checkpoint import shards
from flodl.checkpoint.meta import (
    MAX_META_BYTES,
    SCHEMA_VERSION,
    BundleMeta,
    CheckpointError,
    _tname,
    check_payload,
    installed_version,
)
from flodl.checkpoint.store import _TMP_RE, BundleStore, _classify, _step, normalize_stem

log = logging.getLogger(__name__)

_RESUME_HINT = "restore the files from a backup or start fresh (unset trainer.resume_from)"


def save_bundle(
    stem: str, payload: dict[str, Any], meta: BundleMeta, *, keep_previous: bool = False
) -> BundleMeta:
    """Write ``<stem>.pt`` and ``<stem>.meta.json`` atomically (see the module doc).

    Returns the meta as written (``pt_sha256``, ``pt_bytes``, ``flodl_version`` and ``source``
    filled); the caller's object is not modified. ``keep_previous=True`` keeps the bundle this
    one replaces as ``<stem>.prev.{pt,meta.json}``, a fallback if the new one is later damaged.
    Raises :class:`CheckpointError` for a payload that could not be resumed from, or an I/O
    failure (the last good bundle is then untouched).
    """
    stem = normalize_stem(stem)
    if not isinstance(payload, dict):
        raise CheckpointError(
            f"cannot save checkpoint {stem}.pt: the payload must be a dict, got {_tname(payload)}"
        )
    if meta.schema_version != SCHEMA_VERSION:
        raise CheckpointError(
            f"cannot save checkpoint {stem}: meta.schema_version is {meta.schema_version}, "
            f"this flodl writes {SCHEMA_VERSION}"
        )
    check_payload(payload, "", stem)
    buf = io.BytesIO()
    try:
        torch.save(payload, buf)
    except Exception as exc:
        raise CheckpointError(
            f"cannot save checkpoint {stem}.pt: torch.save failed: {exc}"
        ) from exc
    data = buf.getvalue()
    meta = replace(
        meta,
        pt_sha256=hashlib.sha256(data).hexdigest(),
        pt_bytes=len(data),
        flodl_version=meta.flodl_version or installed_version(),
        source=stem,
    )
    try:
        meta_bytes = json.dumps(meta.to_dict(), indent=1, sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"cannot save checkpoint {stem}.meta.json: the metadata is not JSON ({exc})"
        ) from exc
    BundleMeta.from_dict(json.loads(meta_bytes), source=stem)  # never write what load refuses

    store = BundleStore(stem)
    base = store.base
    tag = secrets.token_hex(6)
    tmp_pt, tmp_meta = f"{base}.pt.tmp-{tag}", f"{base}.meta.json.tmp-{tag}"
    try:
        store.makedirs()
        store.write(tmp_pt, data)
        _step("tmp_pt")
        store.write(tmp_meta, meta_bytes)
        _step("tmp_meta")
        store.sync_dir()
    except Exception as exc:  # a failed write: drop our temporaries, the old bundle stands
        for name in (tmp_pt, tmp_meta):
            try:
                store.remove(name)
            except Exception:
                pass
        raise CheckpointError(
            f"cannot write checkpoint {stem}.pt: {exc}; the previous bundle (if any) is "
            "untouched; check the location and free space"
        ) from exc

    # A complete new pair now exists under temporary names; load_bundle would already find it.
    try:
        present = store.listing()
        if f"{base}.pt" in present:
            store.move(f"{base}.pt", f"{base}.prev.pt")
            _step("park_pt")
        if f"{base}.meta.json" in present:
            store.move(f"{base}.meta.json", f"{base}.prev.meta.json")
            _step("park_meta")
        store.move(tmp_pt, f"{base}.pt")
        _step("commit_pt")
        store.move(tmp_meta, f"{base}.meta.json")
        _step("commit_meta")
        store.sync_dir()
    except Exception as exc:
        raise CheckpointError(
            f"cannot commit checkpoint {stem}: {exc}; the new bundle was written as "
            f"{store.shown(tmp_pt)} and load_bundle will still find it"
        ) from exc

    for name in store.listing():
        suffix = name[len(base) :]
        if _TMP_RE.fullmatch(suffix) or (
            not keep_previous and suffix in (".prev.pt", ".prev.meta.json")
        ):
            try:
                store.remove(name)
            except Exception as exc:  # leftovers are harmless: the next save retries
                log.warning("could not remove stale checkpoint file %s: %s", store.shown(name), exc)
    _step("cleanup")
    return meta


@dataclass
class _Candidate:
    meta: BundleMeta
    name: str
    group: str

    def key(self) -> tuple[int, int, int, float, int]:
        m = self.meta
        prefer = {"": 2, "prev": 0}.get(self.group, 1)
        return (m.epoch, m.global_step, m.sync_round, m.saved_at, prefer)


def _read_metas(store: BundleStore, files: dict[str, int]) -> tuple[list[_Candidate], list[str]]:
    found: list[_Candidate] = []
    problems: list[str] = []
    for name, size in sorted(files.items()):
        kind_group = _classify(name[len(store.base) :])
        if kind_group is None or kind_group[0] != "meta":
            continue
        group = kind_group[1]
        shown = store.shown(name)
        try:
            if size > MAX_META_BYTES:
                raise CheckpointError(f"checkpoint meta {shown} is {size} bytes, not a meta.json")
            raw = store.read(name)
            try:
                d = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise CheckpointError(
                    f"checkpoint meta {shown} is not valid JSON ({exc}); the bundle is corrupt"
                ) from None
            meta = BundleMeta.from_dict(d, source=shown)
            meta.source = store.stem
            found.append(_Candidate(meta, name, group))
        except CheckpointError as exc:
            # A torn temporary is the normal trace of an interrupted save; say nothing of it.
            if not group.startswith("tmp-"):
                problems.append(str(exc))
        except Exception as exc:  # OSError, or a remote filesystem's own error
            if not group.startswith("tmp-"):
                problems.append(f"cannot read checkpoint meta {shown}: {exc}")
    return found, problems


def _pt_names(store: BundleStore, files: dict[str, int], cand: _Candidate) -> list[str]:
    """The .pt files that could belong to ``cand``: its namesake first, then the others."""
    suffix = ".pt" if not cand.group else (".prev.pt" if cand.group == "prev" else None)
    if suffix is None:
        namesake = f"{store.base}.pt.{cand.group}"
    else:
        namesake = store.base + suffix
    others = sorted(
        n
        for n in files
        if n != namesake and (_classify(n[len(store.base) :]) or ("", ""))[0] == "pt"
    )
    return [namesake, *others]


def _load_candidate(
    store: BundleStore,
    files: dict[str, int],
    cand: _Candidate,
    blobs: dict[str, bytes],
    hashes: dict[str, str],
    map_location: Any,
) -> tuple[tuple[str, dict[str, Any]] | None, list[str]]:
    """Find and load the .pt that ``cand`` describes: ((shown name, payload) | None, problems).

    Problems are reported for the meta's namesake .pt and for a matching .pt that will not load;
    another .pt merely not matching is not a problem (it belongs to another meta).
    """
    m = cand.meta
    meta_shown = store.shown(cand.name)
    problems: list[str] = []
    for i, name in enumerate(_pt_names(store, files, cand)):
        shown = store.shown(name)
        namesake = i == 0
        if name not in files:
            if namesake and not cand.group.startswith("tmp-"):
                problems.append(f"checkpoint {shown} is missing ({meta_shown} describes it)")
            continue
        if files[name] != m.pt_bytes:
            if namesake:
                problems.append(
                    f"checkpoint {shown} is corrupt or truncated ({files[name]} bytes, "
                    f"{meta_shown} records {m.pt_bytes})"
                )
            continue
        try:
            if name not in blobs:
                blobs[name] = store.read(name)
                hashes[name] = hashlib.sha256(blobs[name]).hexdigest()
        except Exception as exc:
            problems.append(f"cannot read checkpoint {shown}: {exc}")
            continue
        if hashes[name] != m.pt_sha256:
            if namesake:
                problems.append(
                    f"checkpoint {shown} is corrupt or truncated (sha256 mismatch with "
                    f"{meta_shown})"
                )
            continue
        try:
            payload = torch.load(
                io.BytesIO(blobs[name]), map_location=map_location, weights_only=True
            )
        except Exception as exc:
            text = str(exc).strip()
            detail = text.splitlines()[0][:300] if text else repr(exc)
            problems.append(
                f"checkpoint {shown} cannot be loaded with torch.load(weights_only=True) "
                f"({type(exc).__name__}: {detail})"
            )
            continue
        if not isinstance(payload, dict):
            problems.append(f"checkpoint {shown} holds a {_tname(payload)}, not a dict")
            continue
        return (shown, payload), []
    return None, problems


def load_bundle(
    stem: str, map_location: Any = "cpu", *, fallback: bool = False
) -> tuple[dict[str, Any], BundleMeta]:
    """Load the newest complete bundle at ``stem``: ``(payload, meta)``.

    Verifies every file against the size and sha256 recorded in its meta, then loads it with
    ``torch.load(weights_only=True)``. A sharded bundle (schema 2) is assembled into the same
    payload shape (``params``, ``buffers``, ``optimizer``/``scheduler``/``rng``/``extra`` by
    rank, ``outer``, ``controller``). A damaged newest bundle is an error that names the older
    complete one (a ``.prev`` bundle, or the pair an interrupted save left) and both epochs;
    ``fallback=True`` loads the older one instead, with a warning. With nothing complete,
    :class:`CheckpointError` names the file and the problem.
    """
    stem = normalize_stem(stem)
    store = BundleStore(stem)
    try:
        files = store.listing()
    except Exception as exc:
        raise CheckpointError(f"cannot list checkpoint location {stem}: {exc}") from exc
    metas, problems = _read_metas(store, files)
    if not metas and not problems:
        pts = [n for n in files if (_classify(n[len(store.base) :]) or ("", ""))[0] == "pt"]
        if pts:
            raise CheckpointError(
                f"no checkpoint at {stem}.meta.json (found {store.shown(sorted(pts)[0])} "
                "without its meta.json: the bundle is incomplete); " + _RESUME_HINT
            )
        raise CheckpointError(
            f"no checkpoint at {stem}.meta.json; check trainer.resume_from (a stem, without "
            "extension) or start fresh"
        )

    metas.sort(key=_Candidate.key, reverse=True)
    blobs: dict[str, bytes] = {}
    hashes: dict[str, str] = {}
    failed: list[_Candidate] = []
    for cand in metas:
        if cand.meta.shards:
            loaded, trouble = _load_sharded(store, files, cand)
        else:
            loaded, trouble = _load_candidate(store, files, cand, blobs, hashes, map_location)
        if loaded is None:
            if not cand.group.startswith("tmp-"):  # an uncommitted save is no loss
                problems.extend(trouble)
                failed.append(cand)
            continue
        shown, payload = loaded
        if problems:
            _fall_back(problems, failed, shown, cand.meta, fallback)
        return payload, cand.meta
    raise CheckpointError(
        f"{problems[0]}; no complete bundle was found at {stem}: {_RESUME_HINT}"
        if problems
        else f"no complete checkpoint at {stem}: no .pt matches its meta.json; {_RESUME_HINT}"
    )


def _fall_back(
    problems: list[str], failed: list[_Candidate], shown: str, older: BundleMeta, fallback: bool
) -> None:
    """The newest bundle is damaged and an older one is complete: an error unless asked for."""
    newest = f"epoch {failed[0].meta.epoch}" if failed else "unreadable"
    text = (
        f"{'; '.join(problems)}; the newest bundle ({newest}) is damaged, the last good one is "
        f"{shown} (epoch {older.epoch}, step {older.global_step})"
    )
    if not fallback:
        raise CheckpointError(
            f"{text}: restore the newest from a backup, or resume from the older one on purpose "
            "(trainer.resume_fallback=true)"
        )
    log.warning("%s; loading that (trainer.resume_fallback=true)", text)


def _load_sharded(
    store: BundleStore, files: dict[str, int], cand: _Candidate
) -> tuple[tuple[str, dict[str, Any]] | None, list[str]]:

    try:
        problems = shards.shard_problems(store, cand.meta, files)
        if problems:
            return None, problems
        return (store.shown(cand.name), shards.assemble(store.stem, cand.meta)), []
    except CheckpointError as exc:
        return None, [str(exc)]


def bundle_exists(stem: str) -> bool:
    """Is there a bundle at ``stem``? (A meta that parses and a ``.pt`` of its size; not hashed.)"""
    stem = normalize_stem(stem)
    store = BundleStore(stem)
    try:
        files = store.listing()
    except Exception:
        return False
    metas, _ = _read_metas(store, files)
    return any(_present(store, files, c) for c in metas)


def _present(store: BundleStore, files: dict[str, int], cand: _Candidate) -> bool:
    if cand.meta.shards:
        return all(
            isinstance(s, dict) and files.get(s.get("file", "")) == s.get("bytes")
            for s in cand.meta.shards.values()
        )
    return any(files.get(n) == cand.meta.pt_bytes for n in _pt_names(store, files, cand))


def check_compatible(meta: BundleMeta, *, signature: str, world_size: int) -> None:
    """Refuse a bundle of another model or another cluster size, saying what to do instead."""
    where = f"checkpoint {meta.source}" if meta.source else "checkpoint"
    if meta.signature != signature:
        raise CheckpointError(
            f"{where} was saved for another model (signature {meta.signature} != {signature}); "
            "point trainer.resume_from at a bundle of this model"
        )
    if meta.world_size != world_size:
        raise CheckpointError(
            f"{where} was saved by {meta.world_size} ranks, this run has {world_size}: resume "
            f"with the same cluster size (cluster.ranks={meta.world_size}) or start fresh"
        )


def model_signature(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """Architecture fingerprint: a hash of the state dict's names, shapes and dtypes (16 hex)."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return h.hexdigest()[:16]


def probe_writable(stem: str) -> None:
    """Create the stem's directory and a probe file there, then delete it; raise
    :class:`CheckpointError` saying what failed (run before training, never after it)."""
    stem = normalize_stem(stem)
    store = BundleStore(stem)
    probe = store.full(f"{store.base}.write-probe-{os.getpid()}")
    try:
        store.makedirs()
        with store.fs.open(probe, "wb") as sink:
            sink.write(b"flodl")
        store.fs.rm(probe)
    except Exception as exc:
        raise CheckpointError(f"cannot write at {stem}: {type(exc).__name__}: {exc}") from None
