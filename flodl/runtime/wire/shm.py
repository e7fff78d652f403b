"""A control channel's shared-memory side: bulk tensors between processes of one host.

Over loopback TCP every byte of a cpu_* round is copied four times on the host's cores (into
the sender's socket buffer, out into the receiver, both ways) and the round costs ~2.5x a gloo
all-reduce of the same vector. Between two processes that see the same ``/dev/shm``, a message's
tensors go through a file there instead: the sender ``pwrite``\\ s them (one copy, into the page
cache), the receiver maps the pages (no copy at all: a received tensor *is* the mapping, private
copy-on-write), and only the pickled skeleton travels on the socket.

* **Negotiated** in the handshake, after both sides authenticated: each side creates its own
  outgoing file holding a random token, the other must open it and read the token back. A rank
  on another host (or another container's ``/dev/shm``) cannot, and the channel stays TCP only.
  The server (the launcher) may refuse (``cluster.shared_memory=false``).
* **No names left behind**: the receiver unlinks the peer's file as soon as it has opened it;
  both keep their descriptors, so the memory goes away with the last process holding it (a
  SIGKILL included). A side that closes removes the names of its own files the peer never
  opened; the launcher, at teardown, those its ranks' processes left (:func:`sweep`: a rank
  killed after naming a new file in a message the launcher did not read).
* **One message per file at a time.** The sender claims a free file of its own (making another,
  up to :data:`MAX_FILES`, when all are held), writes, and sends the skeleton with where each
  tensor lies (and the file's name the first time: the receiver opens it and removes the name);
  the receiver acknowledges (a frame naming the file) once nothing of that message's mapping is
  referenced any more: at once for a snapshot the launcher summed as it read it, when the rank
  dropped an Average after loading it, never for what it keeps (the final weights). With every
  file held, a message goes over TCP as before. So does one that does not fit: a write that
  fails (a full ``/dev/shm``: Docker's default is 64 MB) turns the channel's shared memory off,
  with a warning.
* **Memory**: a file keeps the largest message sent through it (its pages are reused by the
  next one instead of being allocated again: a fresh tmpfs page costs twice a reused one). A
  file the receiver still maps *is* the receiver's copy, not an extra one. In a cpu_sync or
  cpu_cadence round that is one snapshot up and one average down per rank: 2 P of ``/dev/shm``
  per rank on the launcher's host for P bytes of weights (3 P in cpu_async, whose next average
  may arrive before the last is loaded), counted by the kernel as shared memory, not in any
  process's resident set except while mapped.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "flodl-"
#: Messages whose tensors hold fewer bytes stay on TCP (a plan's ids, a heartbeat, a metric).
MIN_BYTES = 1 << 20
#: Outgoing files per channel: a message the receiver keeps (the final weights, a dataset in
#: the job) holds one, cpu_async's next average takes another; past this, TCP.
MAX_FILES = 3
#: Tensors start on page boundaries in the file (a mapping's offset must be one).
ALIGN = mmap.ALLOCATIONGRANULARITY
#: A consumed tensor is mapped in windows of this size (the launcher's resident set stays small).
WINDOW_BYTES = 64 << 20
_TOKEN_BYTES = 16
_MAX_IO = 1 << 30  # bytes per pwrite call (Linux caps one call at ~2 GiB)


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _check_path(path: str) -> bool:
    """Only ever a file of ours, in the one directory."""
    name = os.path.basename(path)
    return os.path.dirname(path) == SHM_DIR and name.startswith(PREFIX) and "/" not in name


def _unlink(path: str) -> bool:
    """Remove a name; False when it is already gone (or cannot be removed)."""
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def _open_read(path: str) -> int:
    return os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))


@dataclass
class _File:
    """One of our outgoing files: it holds at most one message until the peer acknowledges."""

    fd: int
    path: str
    free: bool = True
    announced: bool = False  # the peer has opened it (the first file: in the handshake)


class SharedSide:
    """One channel's shared memory: our outgoing files (up to :data:`MAX_FILES`, each holding
    one message until the peer is done with it) and the peer's, mapped on receipt."""

    def __init__(self) -> None:
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.files: list[_File] = []
        self.peer: dict[int, int] = {}  # the peer's file number -> our read descriptor
        self.enabled = True
        self.pid = os.getpid()  # a forked child (a DataLoader worker) never acknowledges
        self._lock = threading.Lock()
        self._users = 0  # threads using a descriptor now: close() waits for the last one
        self._closed = False
        self.sent = self.received = 0  # messages that went through shared memory, each way
        first = self._create()
        try:
            os.pwrite(first.fd, self.token, 0)
        except OSError:
            self.close()
            raise

    @contextmanager
    def using(self) -> Iterator[None]:
        """Hold the descriptors open while they are used: a ``close`` meanwhile (teardown, on
        another thread) closes them after the last user, never under a ``pwrite`` or ``mmap``
        (a closed descriptor's number may name another file a moment later). OSError if closed."""
        with self._lock:
            if self._closed:
                raise OSError("the channel's shared memory is closed")
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                last = self._closed and self._users == 0
            if last:
                self._close_descriptors()

    def _create(self) -> _File:
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        file = _File(fd, path)
        self.files.append(file)
        return file

    # -- negotiation -----------------------------------------------------------------------
    @property
    def probe(self) -> bytes:
        """What the peer needs to find our first file and prove it sees the same one."""
        return self.files[0].path.encode() + b"\0" + self.token.hex().encode()

    def open_peer(self, probe: bytes) -> bool:
        """Open the peer's file named in ``probe`` and check its token; True if it is shared."""
        try:
            path_b, token_hex = probe.split(b"\0")
            path = path_b.decode()
            token = bytes.fromhex(token_hex.decode())
        except (ValueError, UnicodeDecodeError):
            return False
        if not _check_path(path):
            return False
        try:
            fd = _open_read(path)
        except OSError:
            return False  # another host, another container's /dev/shm
        try:
            ok = os.pread(fd, len(token), 0) == token
        except OSError:
            ok = False
        if not ok:
            os.close(fd)
            return False
        self.peer[0] = fd
        return True

    def agreed(self, peer_probe: bytes) -> None:
        """Both sides hold each other's first file: the peer's name is not needed any more
        (ours is removed by the peer), and ours counts as announced."""
        self.files[0].announced = True
        with suppress(ValueError, UnicodeDecodeError):
            _unlink(peer_probe.split(b"\0")[0].decode())

    # -- sending ---------------------------------------------------------------------------
    def claim(self, nbytes: int) -> tuple[int, str | None] | None:
        """A free file for one message of ``nbytes``: ``(number, its path if the peer has not
        opened it yet)``; None when every file is held and no other may be made."""
        with self._lock:
            if not self.enabled:
                return None
            free = [i for i, f in enumerate(self.files) if f.free]
            if not free:
                if len(self.files) >= MAX_FILES:
                    return None
                try:
                    self._create()
                except OSError:
                    return None
                free = [len(self.files) - 1]
            # the smallest file that holds it without growing, else the largest (grows least)
            sizes = {i: os.fstat(self.files[i].fd).st_size for i in free}
            fits = [i for i in free if sizes[i] >= nbytes]
            number = min(fits, key=sizes.__getitem__) if fits else max(free, key=sizes.__getitem__)
            file = self.files[number]
            file.free = False
            return number, None if file.announced else file.path

    def release(self, number: int) -> None:
        """The peer acknowledged (or the write failed): the file is free again."""
        with self._lock:
            if 0 <= number < len(self.files):
                self.files[number].free = True

    def sent_to(self, number: int) -> None:
        """The message naming file ``number`` went out: the peer opens it on receipt."""
        self.files[number].announced = True

    def write(self, number: int, views: list[memoryview]) -> list[int] | None:
        """Write each tensor's bytes at its aligned offset; the offsets, or None (the write
        failed: shared memory is off for this channel from now on, the message goes by TCP)."""
        fd = self.files[number].fd
        offsets, pos = [], 0
        for view in views:
            offsets.append(pos)
            pos = aligned(pos + len(view))
        try:
            with self.using():
                grow = pos - os.fstat(fd).st_size
                if grow > 0:
                    vfs = os.statvfs(SHM_DIR)
                    if grow > vfs.f_bavail * vfs.f_frsize:
                        raise OSError(f"{SHM_DIR} has too little space left for {pos} bytes")
                for offset, view in zip(offsets, views, strict=True):
                    done = 0
                    while done < len(view):
                        done += os.pwrite(fd, view[done : done + _MAX_IO], offset + done)
        except OSError as exc:
            self.enabled = False
            self.release(number)
            log.warning(
                "shared memory for the control channel is off from now on (%s); bulk tensors "
                "go over TCP",
                exc,
            )
            return None
        self.sent += 1
        return offsets

    # -- receiving -------------------------------------------------------------------------
    def open_announced(self, number: int, path: str | None) -> int:
        """Our descriptor of the peer's file ``number``, opened (and its name removed) the first
        time a message names its path. ValueError if it cannot be."""
        fd = self.peer.get(number)
        if fd is not None:
            return fd
        if path is None or not isinstance(number, int) or not 0 <= number < MAX_FILES:
            raise ValueError(f"the peer's shared file {number!r} was never announced")
        if not _check_path(path):
            raise ValueError(f"the peer named a file outside {SHM_DIR}: {path!r}")
        fd = _open_read(path)
        _unlink(path)
        self.peer[number] = fd
        return fd

    def check(self, fd: int, offset: int, nbytes: int) -> None:
        """ValueError unless ``offset..offset+nbytes`` lies inside the peer's file (a mapping
        past its end would fault on first touch)."""
        if offset < 0 or offset % ALIGN or offset + nbytes > os.fstat(fd).st_size:
            raise ValueError(f"region {offset}+{nbytes} is outside the peer's shared file")

    @staticmethod
    def map(fd: int, offset: int, nbytes: int) -> mmap.mmap:
        """A private (copy-on-write) mapping of the peer's bytes: the receiver may change them."""
        return mmap.mmap(
            fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
        )

    def consume(
        self,
        fd: int,
        offset: int,
        nbytes: int,
        consume: Callable[[int, memoryview], None],
        piece: int,
    ) -> None:
        """Hand ``nbytes`` from ``offset`` to ``consume(byte_offset, view)`` in pieces of at
        most ``piece`` bytes (aligned on it), one window mapped at a time."""
        pos = 0
        while pos < nbytes:
            size = min(WINDOW_BYTES, nbytes - pos)
            window = self.map(fd, offset + pos, size)
            try:
                view = memoryview(window)
                try:
                    start = 0
                    while start < size:
                        k = min(piece - (pos + start) % piece, size - start)
                        consume(pos + start, view[start : start + k])
                        start += k
                finally:
                    view.release()
            finally:
                window.close()
            pos += size

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.enabled = False
            now = self._users == 0
        if now:
            self._close_descriptors()
        for file in self.files:  # a name the peer never got to open (gone, or not read) is ours
            _unlink(file.path)  # False: the peer opened it and removed it

    def _close_descriptors(self) -> None:
        for fd in [f.fd for f in self.files] + list(self.peer.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        self.peer.clear()


def sweep(pid: int) -> int:
    """Remove the names process ``pid`` left in ``/dev/shm`` (a rank SIGKILLed after naming a
    file in a message the launcher never read): the launcher calls this for its ranks at
    teardown. The count removed."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    mine = [n for n in names if n.startswith(f"{PREFIX}{pid}-")]
    return sum(_unlink(os.path.join(SHM_DIR, n)) for n in mine)


def tensors_from(
    region: mmap.mmap,
    base: int,
    offsets: list[int],
    descriptors: list,
    on_release: Callable[[], None],
) -> list[torch.Tensor]:
    """Tensors over one mapping (no copy); ``on_release`` runs once none of them is referenced."""
    from flodl.runtime.wire import streaming

    out = []
    for offset, descriptor in zip(offsets, descriptors, strict=True):
        dtype, shape = streaming._dtype(descriptor)
        n = streaming.nbytes(descriptor)
        if n == 0:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        raw = torch.frombuffer(region, dtype=torch.uint8, count=n, offset=offset - base)
        out.append(raw.view(dtype).reshape(shape))
    # Not at interpreter exit: a process going away acknowledges nothing (its socket closes).
    weakref.finalize(region, on_release).atexit = False
    return out


__all__ = ["MIN_BYTES", "SharedSide", "available", "sweep", "tensors_from"]
