"""Where bundles live: a stem on any fsspec filesystem, its files classified (current, parked,
temporary), written atomically.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from flodl.checkpoint.meta import CheckpointError

#: Test seam: called with the name of each save step as it completes (see tests/unit).
_step_hook: Callable[[str], None] | None = None


_TMP_RE = re.compile(r"\.(?:pt|meta\.json)\.tmp-[0-9a-f]+")


def normalize_stem(stem: str) -> str:
    if not isinstance(stem, str) or not stem.strip():
        raise CheckpointError(f"checkpoint stem must be a non-empty path or URL, got {stem!r}")
    stem = stem.strip()
    for ext in (".meta.json", ".pt"):
        if stem.endswith(ext) and len(stem) > len(ext):
            stem = stem[: -len(ext)]
            break
    base = stem.rstrip("/").rsplit("/", 1)[-1]
    if stem.endswith("/") or not base:
        raise CheckpointError(
            f"checkpoint stem {stem} names a directory; give a file stem such as {stem}run"
        )
    if base.endswith(".prev") or _TMP_RE.search(base):
        raise CheckpointError(
            f"checkpoint stem {stem} ends in a name flodl reserves for its own files "
            "('.prev', '.tmp-'); choose another stem"
        )
    return stem


def _classify(suffix: str) -> tuple[str, str] | None:
    """``suffix`` (the file name minus the stem's) -> (kind, group), or None if not ours."""
    if suffix == ".pt":
        return "pt", ""
    if suffix == ".meta.json":
        return "meta", ""
    if suffix == ".prev.pt":
        return "pt", "prev"
    if suffix == ".prev.meta.json":
        return "meta", "prev"
    m = re.fullmatch(r"\.(pt|meta\.json)\.tmp-([0-9a-f]+)", suffix)
    if m:
        return ("pt" if m.group(1) == "pt" else "meta"), "tmp-" + m.group(2)
    return None


class BundleStore:
    """The directory holding a stem's files, on a local disk (with fsync) or any fsspec fs."""

    def __init__(self, stem: str) -> None:
        self.stem = stem
        try:
            fs, path = fsspec.core.url_to_fs(stem)
        except (ImportError, ValueError) as exc:
            raise CheckpointError(f"cannot open checkpoint location {stem}: {exc}") from None
        self.fs = fs
        self.local = isinstance(fs, LocalFileSystem)
        path = path.rstrip("/")
        self.dir, self.base = posixpath.split(path)
        if self.local:
            self.dir, self.base = os.path.split(os.path.abspath(path))

    def shown(self, name: str) -> str:
        """How a file is named in messages: the user's stem plus our suffix."""
        return self.stem + name[len(self.base) :]

    def full(self, name: str) -> str:
        return os.path.join(self.dir, name) if self.local else posixpath.join(self.dir, name)

    def makedirs(self) -> None:
        if self.dir:
            self.fs.makedirs(self.dir, exist_ok=True)

    def listing(self) -> dict[str, int]:
        """Our files in the directory: name -> size."""
        out: dict[str, int] = {}
        if self.local:
            try:
                with os.scandir(self.dir or ".") as it:
                    for e in it:
                        if e.name.startswith(self.base + ".") and e.is_file():
                            out[e.name] = e.stat().st_size
            except (FileNotFoundError, NotADirectoryError):
                pass
            return out
        try:
            self.fs.invalidate_cache(self.dir)
            entries = self.fs.ls(self.dir, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return out
        for e in entries:
            name = posixpath.basename(str(e.get("name", "")).rstrip("/"))
            if e.get("type") == "file" and name.startswith(self.base + "."):
                out[name] = int(e.get("size") or 0)
        return out

    def write(self, name: str, data: bytes) -> None:
        if self.local:
            with open(self.full(name), "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            with self.fs.open(self.full(name), "wb") as f:
                f.write(data)

    def read(self, name: str) -> bytes:
        if self.local:
            with open(self.full(name), "rb") as f:
                return f.read()
        return bytes(self.fs.cat_file(self.full(name)))

    def move(self, src: str, dst: str) -> None:
        if self.local:
            os.replace(self.full(src), self.full(dst))
        else:
            self.fs.mv(self.full(src), self.full(dst))

    def remove(self, name: str) -> None:
        try:
            if self.local:
                os.unlink(self.full(name))
            else:
                self.fs.rm(self.full(name))
        except FileNotFoundError:
            pass

    def sync_dir(self) -> None:
        """Make renames and new directory entries durable (local POSIX disks only)."""
        if not self.local or os.name != "posix":
            return
        try:
            fd = os.open(self.dir or ".", os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Write a local file all at once: ``write`` fills a temporary beside it (fsync'd), which
    then replaces ``path`` (and the directory entry is synced). A failure leaves the previous
    file, or none, never a truncated one, and says "no space left on <path>" for a full disk
    (torch.save reports one as "unexpected pos ..."): :class:`OSError`."""
    from flodl.monitor.failures import disk_full, write_failure

    target = Path(path)
    store = BundleStore(str(target))
    tmp = f"{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(store.full(tmp), "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        store.move(tmp, target.name)
    except Exception as exc:
        store.remove(tmp)
        full = disk_full(exc) or no_room(store.dir)
        code = errno.ENOSPC if full else getattr(exc, "errno", None) or errno.EIO
        message = f"no space left on {target}" if full else write_failure(exc, target)
        raise OSError(code, message) from exc
    store.sync_dir()


def no_room(directory: str) -> bool:
    """The filesystem holding ``directory`` has (almost) no free blocks left."""
    try:
        st = os.statvfs(directory or ".")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024


def _step(name: str) -> None:
    if _step_hook is not None:
        _step_hook(name)
