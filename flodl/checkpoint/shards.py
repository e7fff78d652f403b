"""Sharded checkpoint bundles: each writer streams its own shard file; ``<stem>.meta.json`` last.

Layout of a bundle at stem ``ckpt/run`` (any fsspec URL works the same way)::

    ckpt/run.meta.json                the commit marker: BundleMeta, schema 2, with every
                                      shard's file name, byte size and sha256
    ckpt/run.<tag>.model.pt           consensus parameters + buffers (+ collective outer momentum),
                                      written once, by one surviving rank (not necessarily rank 0)
    ckpt/run.<tag>.rank<r>.pt         rank r's optimizer, scheduler, RNG states and ``extra``
    ckpt/run.<tag>.controller.pt      controller-side state of cpu_* modes (EASGD centre,
                                      outer momentum), when there is any

``<tag>`` is fresh per save, so a save never overwrites a file a committed bundle refers to.
Shards are ``torch.save`` d straight into the destination (hashed while written: no serialised
copy in memory) and loaded with ``torch.load(weights_only=True)`` (memory-mapped on a local
disk). Only the meta names a bundle into existence: it is written last (a temporary file and
``os.replace`` on a local disk; a single PUT, atomic by itself, on object stores without rename,
``memory://``, ``s3://``), so an interrupted save leaves the previous bundle in force and at most
some orphan shards, which the next successful save removes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from flodl.checkpoint.meta import BundleMeta, CheckpointError, check_payload, installed_version
from flodl.checkpoint.store import BundleStore, no_room, normalize_stem

log = logging.getLogger(__name__)

SHARDED_SCHEMA = 2
MODEL = "model"
CONTROLLER = "controller"
_BLOCK = 8 << 20


def rank_shard(rank: int) -> str:
    return f"rank{rank}"


def new_tag() -> str:
    """A fresh save tag (names this save's shard files)."""
    return secrets.token_hex(6)


def _shard_re(base: str) -> re.Pattern[str]:
    return re.compile(re.escape(base) + r"\.([0-9a-f]{12})\.(model|controller|rank\d+)\.pt")


@dataclass(frozen=True)
class ShardInfo:
    """One written shard: its file name (in the stem's directory), size and sha256."""

    file: str
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, where: str, name: str, d: Any) -> ShardInfo:
        ok = (
            isinstance(d, Mapping)
            and isinstance(d.get("file"), str)
            and isinstance(d.get("bytes"), int)
            and isinstance(d.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", d["sha256"]) is not None
        )
        if not ok:
            raise CheckpointError(f"{where}: shards.{name} must be {{file, bytes, sha256}}")
        return cls(d["file"], int(d["bytes"]), d["sha256"])


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range, do not wait for it
_writeback: Any = None  # libc's sync_file_range, once looked up (False: not available)


def _start_writeback(fd: int, offset: int, n: int) -> None:
    """Ask the kernel to start writing ``n`` bytes at ``offset`` to disk now (Linux; elsewhere
    nothing): the final fsync then waits for the tail only, not for the whole file."""
    global _writeback
    if _writeback is None:
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            call = libc.sync_file_range
            call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            _writeback = call
        except (OSError, AttributeError):
            _writeback = False
    if _writeback:
        _writeback(fd, offset, n, _SYNC_FILE_RANGE_WRITE)  # an error only means "not started"


class _Hashing:
    """A write-only file wrapper that hashes and counts what passes through.

    A large write is cut into parts; each part is hashed on a helper thread while it is written
    (both release the GIL), so hashing costs no extra time next to the disk. Every part is
    hashed before ``write`` returns: torch hands out views of buffers it reuses afterwards.
    On a local file (``fd``) each written part's writeback starts at once, so the disk works
    while the next parts are hashed (measured: bench/bulk.py's disk phase) instead of all at
    the final fsync.
    """

    def __init__(self, f: Any, fd: int | None = None) -> None:
        self.f = f
        self.fd = fd
        self.sha = hashlib.sha256()
        self.n = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _BLOCK):
            part = view[start : start + _BLOCK]
            if len(part) < (1 << 20):
                self.sha.update(part)
                self.f.write(part)
                continue
            hasher = threading.Thread(target=self.sha.update, args=(part,))
            hasher.start()
            try:
                self.f.write(part)  # a part this large bypasses the buffer: it is in the kernel
                if self.fd is not None:
                    _start_writeback(self.fd, self.n + start, len(part))
            finally:
                hasher.join()
        self.n += len(view)
        return len(view)

    def flush(self) -> None:
        self.f.flush()


# -- save ------------------------------------------------------------------------------------------


def write_shard(stem: str, tag: str, name: str, payload: dict[str, Any]) -> ShardInfo:
    """Stream ``payload`` into ``<stem>.<tag>.<name>.pt``; its :class:`ShardInfo`."""
    stem = normalize_stem(stem)
    check_payload(payload, "", stem)
    store = BundleStore(stem)
    file = f"{store.base}.{tag}.{name}.pt"
    try:
        store.makedirs()
        if store.local:
            with open(store.full(file), "xb") as f:
                out: Any = _Hashing(f, f.fileno())
                _save(payload, out)
                f.flush()
                os.fsync(f.fileno())
        else:
            with store.fs.open(store.full(file), "wb") as f:
                out = _Hashing(f)
                _save(payload, out)
    except Exception as exc:
        from flodl.monitor.failures import disk_full

        store.remove(file)
        if disk_full(exc) or (store.local and no_room(store.dir)):  # torch says "unexpected pos"
            raise CheckpointError(
                f"no space left on {store.shown(file)}; the previous bundle is untouched; free "
                "space or point trainer.save_path elsewhere"
            ) from exc
        raise CheckpointError(
            f"cannot write checkpoint shard {store.shown(file)}: {exc}; the previous bundle is "
            "untouched; check the location and free space"
        ) from exc
    return ShardInfo(file, out.n, out.sha.hexdigest())


def _save(payload: dict[str, Any], out: Any) -> None:
    """``torch.save`` without the zip records' CRC32: the shard's sha256 covers every byte, and
    the CRC would halve the write speed (measured: bench/bulk.py)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # an older torch: CRC32 it is
        torch.save(payload, out)
        return
    with config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
        torch.save(payload, out)


def commit(
    stem: str,
    meta: BundleMeta,
    shards: Mapping[str, ShardInfo],
    *,
    keep_previous: bool = False,
    in_flight: Iterable[str] = (),
) -> BundleMeta:
    """Write ``<stem>.meta.json`` naming ``shards``: the bundle exists from here on.

    Then remove shards no meta refers to any more, except those of saves still ``in_flight``
    (their tags). ``keep_previous`` keeps the replaced meta as ``<stem>.prev.meta.json`` (with
    its shards), a fallback :func:`flodl.checkpoint.bundle.load_bundle` uses only when asked to.
    """
    stem = normalize_stem(stem)
    meta = replace(
        meta,
        schema_version=SHARDED_SCHEMA,
        shards={n: s.to_dict() for n, s in shards.items()},
        flodl_version=meta.flodl_version or installed_version(),
        source=stem,
    )
    data = json.dumps(meta.to_dict(), indent=1, sort_keys=True).encode()
    BundleMeta.from_dict(json.loads(data), source=stem)  # never write what load refuses
    store = BundleStore(stem)
    base = store.base
    try:
        present = store.listing()
        if keep_previous and f"{base}.meta.json" in present:
            _put(store, f"{base}.prev.meta.json", store.read(f"{base}.meta.json"))
        _put(store, f"{base}.meta.json", data)
    except Exception as exc:
        raise CheckpointError(
            f"cannot commit checkpoint {stem}.meta.json: {exc}; the previous bundle is untouched"
        ) from exc
    _cleanup(store, keep_previous, set(in_flight))
    return meta


def _put(store: BundleStore, name: str, data: bytes) -> None:
    """Replace ``name`` atomically: tmp + rename on a local disk, one PUT elsewhere."""
    if not store.local:
        with store.fs.open(store.full(name), "wb") as f:
            f.write(data)
        return
    tmp = f"{name}.tmp-{new_tag()}"
    store.write(tmp, data)
    store.move(tmp, name)
    store.sync_dir()


def _referenced(store: BundleStore, name: str) -> set[str]:
    try:
        d = json.loads(store.read(name))
        return {s["file"] for s in (d.get("shards") or {}).values()}
    except Exception:
        return set()


def _cleanup(store: BundleStore, keep_previous: bool, in_flight: set[str]) -> None:
    base = store.base
    files = store.listing()
    keep = _referenced(store, f"{base}.meta.json")
    if keep_previous:
        keep |= _referenced(store, f"{base}.prev.meta.json")
    pattern = _shard_re(base)
    for name in files:
        m = pattern.fullmatch(name)
        stale_tmp = name.startswith(f"{base}.meta.json.tmp-") or name.startswith(
            f"{base}.prev.meta.json.tmp-"
        )
        if (m and name not in keep and m.group(1) not in in_flight) or stale_tmp:
            try:
                store.remove(name)
            except Exception as exc:  # leftovers are harmless: the next save retries
                log.warning("could not remove stale checkpoint file %s: %s", store.shown(name), exc)
    if not keep_previous and f"{base}.prev.meta.json" in files:
        store.remove(f"{base}.prev.meta.json")


def copy_bundle(src: str, dst: str, reason: str) -> BundleMeta:
    """Copy the committed bundle at ``src`` to ``dst`` (its shards streamed file by file, then
    the meta, last, as everywhere): ``trainer.save_best`` keeps the best epoch this way."""
    src, dst = normalize_stem(src), normalize_stem(dst)
    source, target = BundleStore(src), BundleStore(dst)
    meta = BundleMeta.from_dict(json.loads(source.read(f"{source.base}.meta.json")), source=src)
    tag = new_tag()
    written = {}
    target.makedirs()
    for name, info in (meta.shards or {}).items():
        shard = ShardInfo.from_dict(src, name, info)
        file = f"{target.base}.{tag}.{name}.pt"
        with (
            source.fs.open(source.full(shard.file), "rb") as fin,
            target.fs.open(target.full(file), "wb") as fout,
        ):
            shutil.copyfileobj(fin, fout, length=16 << 20)
        written[name] = ShardInfo(file, shard.bytes, shard.sha256)
    return commit(dst, replace(meta, save_reason=reason), written)


def discard(stem: str, tag: str) -> None:
    """Remove the shards of an abandoned save (best effort)."""
    store = BundleStore(normalize_stem(stem))
    for name in store.listing():
        m = _shard_re(store.base).fullmatch(name)
        if m and m.group(1) == tag:
            try:
                store.remove(name)
            except Exception:
                pass


# -- load ------------------------------------------------------------------------------------------


def shard_problems(store: BundleStore, meta: BundleMeta, files: Mapping[str, int]) -> list[str]:
    """What is wrong with a sharded bundle's files: missing, wrong size, wrong sha256."""
    problems = []
    for name, raw in sorted(meta.shards.items()):
        info = ShardInfo.from_dict(f"checkpoint meta {meta.source}", name, raw)
        shown = store.shown(info.file)
        if info.file not in files:
            problems.append(f"checkpoint shard {shown} is missing")
        elif files[info.file] != info.bytes:
            problems.append(
                f"checkpoint shard {shown} is corrupt or truncated ({files[info.file]} bytes, "
                f"the meta records {info.bytes})"
            )
        elif _sha256(store, info.file) != info.sha256:
            problems.append(f"checkpoint shard {shown} is corrupt (sha256 mismatch)")
    return problems


def _sha256(store: BundleStore, name: str) -> str:
    h = hashlib.sha256()
    with (
        open(store.full(name), "rb") if store.local else store.fs.open(store.full(name), "rb")
    ) as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def shard_location(stem: str, file: str) -> str:
    """Where a rank (or the launcher) opens a shard: the stem's directory plus its file name."""
    store = BundleStore(normalize_stem(stem))
    path = store.full(file)
    protocol = store.fs.protocol
    protocol = protocol[0] if isinstance(protocol, (list, tuple)) else protocol
    return path if store.local else f"{protocol}://{path.lstrip('/')}"


def load_shard(location: str) -> dict[str, Any]:
    """Load one shard (memory-mapped when it is a local file)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(location)
    try:
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(fs, LocalFileSystem):
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:
            with fs.open(path, "rb") as f:
                payload = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot load checkpoint shard {location}: {exc}") from exc
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint shard {location} holds a {type(payload).__name__}")
    return payload


def process_local(stem: str) -> bool:
    """A store only this process can see (``memory://``): ranks relay shards to the launcher."""
    store = BundleStore(normalize_stem(stem))
    protocol = store.fs.protocol
    protocols = protocol if isinstance(protocol, (list, tuple)) else (protocol,)
    return "memory" in protocols


def assemble(stem: str, meta: BundleMeta) -> dict[str, Any]:
    """Every shard of a (verified) bundle in one payload: the shape of a schema-1 bundle."""
    keys = ("optimizer", "scheduler", "rng", "extra", "scaler")
    payload: dict[str, Any] = {key: {} for key in keys}
    for name, raw in sorted(meta.shards.items()):
        shard = load_shard(shard_location(stem, raw["file"]))
        if name == MODEL:
            payload.update(shard)
        elif name == CONTROLLER:
            payload["controller"] = shard
        else:
            rank = int(name.removeprefix("rank"))
            for key in keys:
                payload[key][rank] = shard.get(key)
    return payload
