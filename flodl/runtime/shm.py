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
  SIGKILL included). A side whose handshake fails removes its own name.
* **One message in the file at a time** per direction. The sender claims the slot, writes, and
  sends the skeleton with where each tensor lies; the receiver acknowledges (a frame of its own)
  once nothing of that message's mapping is referenced any more: at once for a snapshot the
  launcher summed as it read it, when the rank dropped an Average after loading it. A message
  sent while the slot is still held (cpu_async's overshoot, the final weights the launcher
  keeps) goes over TCP as before. So is one that does not fit: a write that fails (a full
  ``/dev/shm``: Docker's default is 64 MB) turns the channel's shared memory off, with a warning.
* **Memory**: the file keeps the largest message sent through it (its pages are reused by the
  next one instead of being allocated again: a fresh tmpfs page costs twice a reused one).
  On one host that is up to two messages per rank (its snapshot up, the average down): 2 P of
  ``/dev/shm`` per rank for P bytes of weights, counted by the kernel as shared memory, not
  in any process's resident set except while mapped.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "flodl-"
#: Messages whose tensors hold fewer bytes stay on TCP (a plan's ids, a heartbeat, a metric).
MIN_BYTES = 1 << 20
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


class SharedSide:
    """Both files of one channel: ours (written, then claimed by one message at a time) and the
    peer's (mapped on receipt)."""

    def __init__(self) -> None:
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path = os.path.join(SHM_DIR, name)
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.pwrite(self.fd, self.token, 0)
        self.peer_fd: int | None = None
        self.enabled = True
        self._free = True  # our file holds no message the peer may still be reading
        self._lock = threading.Lock()
        self.sent = self.received = 0  # messages that went through shared memory, each way

    # -- negotiation -----------------------------------------------------------------------
    @property
    def probe(self) -> bytes:
        """What the peer needs to find our file and prove it sees the same one."""
        return self.path.encode() + b"\0" + self.token.hex().encode()

    def open_peer(self, probe: bytes) -> bool:
        """Open the peer's file named in ``probe`` and check its token; True if it is shared."""
        try:
            path_b, token_hex = probe.split(b"\0")
            path = path_b.decode()
            token = bytes.fromhex(token_hex.decode())
        except (ValueError, UnicodeDecodeError):
            return False
        name = os.path.basename(path)
        if os.path.dirname(path) != SHM_DIR or not name.startswith(PREFIX) or "/" in name:
            return False  # only ever a file of ours, in the one directory
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return False  # another host, another container's /dev/shm
        try:
            ok = os.pread(fd, len(token), 0) == token
        except OSError:
            ok = False
        if not ok:
            os.close(fd)
            return False
        self.peer_fd = fd
        return True

    def unlink_peer(self, probe: bytes) -> None:
        """The peer's name is no longer needed once both sides hold their descriptors."""
        try:
            os.unlink(probe.split(b"\0")[0].decode())
        except (OSError, ValueError, UnicodeDecodeError):
            pass

    # -- sending ---------------------------------------------------------------------------
    def claim(self) -> bool:
        """Take the slot for one message; False while the peer may still read the last one."""
        with self._lock:
            if not (self.enabled and self._free):
                return False
            self._free = False
            return True

    def release(self) -> None:
        """The peer acknowledged (or the write failed): the slot is free again."""
        with self._lock:
            self._free = True

    def write(self, tensors: list[torch.Tensor], views: list[memoryview]) -> list[int] | None:
        """Write each tensor's bytes at its aligned offset; the offsets, or None (the write
        failed: shared memory is off for this channel from now on, the message goes by TCP)."""
        offsets, pos = [], 0
        for view in views:
            offsets.append(pos)
            pos = aligned(pos + len(view))
        try:
            if pos > os.fstat(self.fd).st_size:
                vfs = os.statvfs(SHM_DIR)
                if pos - os.fstat(self.fd).st_size > vfs.f_bavail * vfs.f_frsize:
                    raise OSError(f"{SHM_DIR} has too little space left for {pos} bytes")
            for offset, view in zip(offsets, views):
                done = 0
                while done < len(view):
                    done += os.pwrite(self.fd, view[done : done + _MAX_IO], offset + done)
        except OSError as exc:
            self.enabled = False
            self.release()
            log.warning(
                "shared memory for the control channel is off from now on (%s); bulk tensors "
                "go over TCP",
                exc,
            )
            return None
        self.sent += 1
        del tensors  # the caller's: written, nothing of them is kept
        return offsets

    # -- receiving -------------------------------------------------------------------------
    def check(self, offset: int, nbytes: int) -> None:
        """ValueError unless ``offset..offset+nbytes`` lies inside the peer's file (a mapping
        past its end would fault on first touch)."""
        assert self.peer_fd is not None
        if offset < 0 or offset % ALIGN or offset + nbytes > os.fstat(self.peer_fd).st_size:
            raise ValueError(f"region {offset}+{nbytes} is outside the peer's shared file")

    def map(self, offset: int, nbytes: int) -> mmap.mmap:
        """A private (copy-on-write) mapping of the peer's bytes: the receiver may change them."""
        assert self.peer_fd is not None
        return mmap.mmap(
            self.peer_fd,
            nbytes,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=offset,
        )

    def consume(self, offset: int, nbytes: int, consume: Callable[[int, memoryview], None],
                piece: int) -> None:
        """Hand ``nbytes`` from ``offset`` to ``consume(byte_offset, view)`` in pieces of at
        most ``piece`` bytes (aligned on it), one window mapped at a time."""
        pos = 0
        while pos < nbytes:
            size = min(WINDOW_BYTES, nbytes - pos)
            window = self.map(offset + pos, size)
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
        for fd in (self.fd, self.peer_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.peer_fd = None
        try:  # never opened by a peer (a handshake cut short): the name is still ours to remove
            os.unlink(self.path)
        except OSError:
            pass


def tensors_from(region: mmap.mmap, base: int, offsets: list[int], descriptors: list,
                 on_release: Callable[[], None]) -> list[torch.Tensor]:
    """Tensors over one mapping (no copy); ``on_release`` runs once none of them is referenced."""
    from flodl.runtime import streaming

    out = []
    for offset, descriptor in zip(offsets, descriptors):
        dtype, shape = streaming._dtype(descriptor)
        n = streaming.nbytes(descriptor)
        if n == 0:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        raw = torch.frombuffer(region, dtype=torch.uint8, count=n, offset=offset - base)
        out.append(raw.view(dtype).reshape(shape))
    weakref.finalize(region, on_release)
    return out


__all__ = ["MIN_BYTES", "SharedSide", "available", "tensors_from"]
