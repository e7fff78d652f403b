"""The control plane: length-prefixed frames over TCP, mutually authenticated with a per-run secret.

Handshake (HMAC-SHA256 challenge/response, both directions) happens before a single byte is
unpickled: an unauthenticated peer can only ever make us read a bounded, fixed-size frame, and
is dropped on the first wrong byte. After the handshake, frames carry pickled messages, bounded by
``max_frame`` so a confused peer cannot make us allocate without limit. A message holding tensors
travels as its pickle without them, then their bytes, every part in frames under the bound
(:mod:`flodl.runtime.wire.streaming`): no message size limits the model. Between two processes of
one
host the tensors go through shared memory instead (:mod:`flodl.runtime.wire.shm`, negotiated in the
handshake): only the pickle travels on the socket. The secret travels to ranks on stdin, never
on a command line.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from flodl.runtime.wire import shm, streaming

log = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # a consumed tensor arrives in pieces of this size (aligned)
Consume = Callable[[int, memoryview], None]
Route = Callable[[Any, list], dict[int, Consume]]

_HEADER = struct.Struct("!4sQ")
#: A frame this small goes out with its header in one ``sendall`` (a copy of it, not a second
#: system call: the controller sends a plan to every rank each window); a larger one is sent
#: from where it lies.
_JOIN_BELOW = 64 * 1024
_MAGIC = b"FDL1"
_STREAMED = b"FDL2"  # a message whose skeleton and tensors follow in frames
_SHARED = b"FDL3"  # a message whose skeleton follows in frames, its tensors in shared memory
_ACK = b"FDL4"  # the peer is done with the message in one of our shared files (its number)
_ACK_BODY = struct.Struct("!I")
_CHALLENGE_BYTES = 32
_HANDSHAKE_FRAME = 256
HANDSHAKE_TIMEOUT_S = 5.0
DEFAULT_MAX_FRAME = 256 * 1024 * 1024


class AuthError(ConnectionError):
    """The peer failed the HMAC handshake or spoke garbage before authenticating."""


class FrameError(ConnectionError):
    """A frame broke the protocol: wrong magic or a size above the bound."""


def new_secret() -> bytes:
    """A fresh 256-bit per-run secret."""
    return os.urandom(32)


def _digest(secret: bytes, role: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, role + challenge, hashlib.sha256).digest()


class Channel:
    """One authenticated, framed, thread-safe-for-send connection."""

    def __init__(self, sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self._send_lock = threading.Lock()
        self._closed = False
        self._piece: bytearray | None = None  # receive buffer of consumed (summed) tensors
        self.shm: shm.SharedSide | None = None  # set by the handshake when the peer shares it
        self._acks_owed: list[int] = []  # acknowledgements waiting for the send lock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames, low latency

    # -- raw frames -------------------------------------------------------------------------
    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionResetError("peer closed the control channel")
            got += k
        return bytes(buf)

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = self.sock.recv_into(view[got:], len(view) - got)
            if k == 0:
                raise ConnectionResetError("peer closed the control channel")
            got += k

    def _frame(self, magic: bytes, data: bytes | memoryview) -> None:
        if len(data) > self.max_frame:
            raise FrameError(f"frame of {len(data)} bytes exceeds the {self.max_frame} bound")
        header = _HEADER.pack(magic, len(data))
        if len(data) <= _JOIN_BELOW:  # a control message: one system call, not two
            self.sock.sendall(header + data)
            return
        self.sock.sendall(header)
        self.sock.sendall(data)

    @contextmanager
    def _sending(self) -> Iterator[None]:
        """The send lock; on release, an acknowledgement owed meanwhile goes out."""
        with self._send_lock:
            yield
        self._flush_acks()

    def send_bytes(self, payload: bytes) -> None:
        with self._sending():
            self._frame(_MAGIC, payload)

    def _owe_ack(self, number: int) -> None:
        """Nothing of the message in the peer's shared file ``number`` is referenced any more:
        tell it. Never waits for the send lock (this runs on a reader thread, or wherever the
        last reference went): whoever holds it sends the acknowledgement on release."""
        side = self.shm
        if side is None or side.pid != os.getpid():
            return  # a forked child dropping its copy of the parent's message: not ours to say
        self._acks_owed.append(number)  # list.append/pop: atomic under the GIL
        self._flush_acks()

    def _flush_acks(self) -> None:
        while self._acks_owed and not self._closed:
            if not self._send_lock.acquire(blocking=False):
                return  # the holder flushes after releasing (it checks once it let go)
            try:
                while self._acks_owed:
                    self._frame(_ACK, _ACK_BODY.pack(self._acks_owed.pop()))
            except OSError:
                return  # the peer is gone: nothing to acknowledge to
            finally:
                self._send_lock.release()

    def _header(self, bound: int) -> tuple[bytes, int]:
        magic, size = _HEADER.unpack(self._recv_exact(_HEADER.size))
        if magic not in (_MAGIC, _STREAMED, _SHARED, _ACK):
            raise FrameError("bad frame magic (not a flodl peer)")
        if size > bound:
            raise FrameError(f"frame of {size} bytes exceeds the {bound} bound")
        return magic, size

    def _next_header(self, bound: int) -> tuple[bytes, int]:
        """The next message's header; acknowledgements in between free our shared file."""
        while True:
            magic, size = self._header(bound)
            if magic != _ACK:
                return magic, size
            if size != _ACK_BODY.size or self.shm is None:
                raise FrameError("unexpected acknowledgement frame")
            (number,) = _ACK_BODY.unpack(self._recv_exact(size))
            self.shm.release(number)

    def recv_bytes(self, limit: int | None = None) -> bytes:
        magic, size = self._next_header(self.max_frame if limit is None else limit)
        if magic != _MAGIC:
            raise FrameError("unexpected streamed frame")
        return self._recv_exact(size)

    def _recv_region(self, view: memoryview) -> None:
        """Fill ``view`` from consecutive plain frames (a streamed part, at most the bound each)."""
        pos = 0
        while pos < len(view):
            magic, size = self._header(min(self.max_frame, len(view) - pos))
            if magic != _MAGIC or size == 0:
                raise FrameError("a streamed message was interrupted by another frame")
            self._recv_into(view[pos : pos + size])
            pos += size

    # -- messages (only after authentication) -----------------------------------------------
    def send(self, msg: Any, code: bool = False) -> None:
        """Send a message; its tensors (any size) travel out of band in bounded frames."""
        skeleton, tensors = streaming.split(msg, code)
        if not tensors and len(skeleton) <= self.max_frame:
            self.send_bytes(skeleton)
            return
        views = [streaming.tensor_view(t) for t in tensors]
        shared = self._write_shared(views)
        descriptors = streaming.describe(tensors)
        size = min(streaming.CHUNK_BYTES, self.max_frame)
        with self._sending():
            if shared is not None:
                number, path, offsets = shared
                head = (len(skeleton), descriptors, offsets, number, path)
                self._frame(_SHARED, pickle.dumps(head))
                assert self.shm is not None
                self.shm.sent_to(number)
            else:
                self._frame(_STREAMED, pickle.dumps((len(skeleton), descriptors)))
            for part in streaming.chunks(memoryview(skeleton), size):
                self._frame(_MAGIC, part)
            if shared is None:
                for view in views:
                    for part in streaming.chunks(view, size):
                        self._frame(_MAGIC, part)

    def _write_shared(self, views: list[memoryview]) -> tuple[int, str | None, list[int]] | None:
        """The tensors' bytes written into a free shared file: ``(file number, its path if
        the peer has not opened it, offsets)``; None: they go over TCP."""
        side = self.shm
        total = sum(len(v) for v in views)
        if side is None or total < shm.MIN_BYTES:
            return None
        claimed = side.claim(total)
        if claimed is None:
            return None
        offsets = side.write(claimed[0], views)  # None: it failed (TCP from now on)
        return None if offsets is None else (*claimed, offsets)

    def send_code(self, obj: Any) -> None:
        """Send an object that may hold closures or ``__main__`` functions (cloudpickle)."""
        self.send(obj, code=True)

    def recv(self, route: Route | None = None) -> Any:
        """The next message. ``route`` (for a streamed message) may claim some of its tensors:
        given the message with placeholders, it returns ``{index: consume}``; each claimed
        tensor's bytes then go to ``consume(byte_offset, piece)`` piece by piece (nothing is
        allocated for it) and the message carries None in its place."""
        magic, size = self._next_header(self.max_frame)
        if magic == _MAGIC:
            return pickle.loads(self._recv_exact(size))
        if magic == _SHARED and self.shm is None:
            raise FrameError("a shared-memory message on a channel without shared memory")
        head = pickle.loads(self._recv_exact(size))
        n_skeleton, descriptors = head[0], head[1]
        skeleton = bytearray(n_skeleton)
        self._recv_region(memoryview(skeleton))
        claimed: dict[int, Consume] = {}
        if route is not None:
            peeked = streaming.peek(bytes(skeleton))
            claimed = route(peeked, descriptors) if peeked is not None else {}
        if magic == _SHARED:
            mapped = self._recv_shared(descriptors, head[2:], claimed)
            return streaming.join(bytes(skeleton), mapped)
        try:
            tensors: list[Any] = streaming.allocate(descriptors, skip=set(claimed))
        except (TypeError, ValueError) as exc:
            raise FrameError(f"bad streamed message: {exc}") from None
        for i, t in enumerate(tensors):
            if i in claimed:
                self._recv_consumed(streaming.nbytes(descriptors[i]), claimed[i])
            else:
                self._recv_region(streaming.tensor_view(t))
        return streaming.join(bytes(skeleton), tensors)

    def _recv_shared(self, descriptors: Any, where: Any, claimed: dict[int, Consume]) -> list[Any]:
        """The tensors of a message in one of the peer's shared files (``where``: the offsets,
        the file's number and, the first time, its path): claimed ones handed on in pieces,
        the others mapped (no copy); acknowledged once none of them is referenced."""
        side = self.shm
        assert side is not None
        with side.using():  # the descriptors stay open meanwhile (a close waits)
            try:
                offsets, number, path = where
                sizes = [streaming.nbytes(d) for d in descriptors]
                if not isinstance(offsets, list) or len(offsets) != len(sizes):
                    raise ValueError("offsets do not match the tensors")
                fd = side.open_announced(number, path)
                for offset, n in zip(offsets, sizes, strict=True):
                    side.check(fd, int(offset), n)
            except (TypeError, ValueError, OSError) as exc:
                raise FrameError(f"bad shared-memory message: {exc}") from None
            side.received += 1
            done = partial(self._owe_ack, number)
            for i, consume in claimed.items():
                side.consume(fd, offsets[i], sizes[i], consume, PIECE_BYTES)
            kept = [i for i in range(len(sizes)) if i not in claimed and sizes[i]]
            tensors: list[Any] = [None] * len(sizes)
            for i in range(len(sizes)):
                if i not in claimed and not sizes[i]:
                    tensors[i] = streaming.allocate([descriptors[i]])[0]
            if not kept:
                done()
                return tensors
            base = min(offsets[i] for i in kept)
            end = max(offsets[i] + sizes[i] for i in kept)
            region = side.map(fd, base, end - base)
            mapped = shm.tensors_from(
                region, base, [offsets[i] for i in kept], [descriptors[i] for i in kept], done
            )
            for i, t in zip(kept, mapped, strict=True):
                tensors[i] = t
            return tensors

    def _recv_consumed(self, n: int, consume: Consume) -> None:
        """``n`` bytes from consecutive frames, handed on in pieces aligned on
        :data:`flodl.runtime.controller.sums.PIECE_BYTES` through one reused buffer."""
        if self._piece is None:
            self._piece = bytearray(PIECE_BYTES)
        buf = memoryview(self._piece)
        pos = 0
        while pos < n:
            magic, size = self._header(min(self.max_frame, n - pos))
            if magic != _MAGIC or size == 0:
                raise FrameError("a streamed message was interrupted by another frame")
            end = pos + size
            while pos < end:
                k = min(PIECE_BYTES - pos % PIECE_BYTES, end - pos)
                self._recv_into(buf[:k])
                consume(pos, buf[:k])
                pos += k

    @property
    def closed(self) -> bool:
        return self._closed

    def bound_silence(self, timeout_s: float) -> None:
        """Fail this connection once the peer's host has acknowledged nothing for
        ``timeout_s`` (``TCP_USER_TIMEOUT``, Linux; keep-alive probes keep data in flight when
        nothing else is): a network cut then ends it whatever ssh or sshd keep-alive settings
        are. A peer process that is merely frozen (SIGSTOP) still has its kernel acknowledge,
        so it is not taken for gone."""
        if self.sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        ms = max(1000, int(timeout_s * 1000))
        every = max(1, int(timeout_s / 4))
        opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        for name, value in (
            ("TCP_USER_TIMEOUT", ms),
            ("TCP_KEEPIDLE", every),
            ("TCP_KEEPINTVL", every),
            ("TCP_KEEPCNT", 4),
        ):
            if hasattr(socket, name):
                opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
        for level, opt, value in opts:
            try:
                self.sock.setsockopt(level, opt, value)
            except OSError as exc:  # not Linux, or not a TCP socket after all
                log.debug("socket option %s not set: %s", opt, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.shm is not None:
            self.shm.close()  # mapped tensors keep their pages: the mappings outlive the file
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # -- handshake --------------------------------------------------------------------------
    def authenticate_as_server(self, secret: bytes, shared_memory: bool = True) -> None:
        """Challenge the peer, then answer its challenge; then agree on shared memory (refused
        when not ``shared_memory``). Raises :class:`AuthError`."""
        self.sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            challenge = os.urandom(_CHALLENGE_BYTES)
            self.send_bytes(challenge)
            answer = self.recv_bytes(limit=_HANDSHAKE_FRAME)
            if not hmac.compare_digest(answer, _digest(secret, b"rank", challenge)):
                raise AuthError("peer failed authentication")
            theirs = self.recv_bytes(limit=_HANDSHAKE_FRAME)
            self.send_bytes(_digest(secret, b"controller", theirs))
            self._share_as_server(shared_memory)
        except (OSError, struct.error) as exc:
            raise AuthError(f"handshake failed: {exc}") from None
        finally:
            self.sock.settimeout(None)

    def authenticate_as_client(self, secret: bytes) -> None:
        self.sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            challenge = self.recv_bytes(limit=_HANDSHAKE_FRAME)
            self.send_bytes(_digest(secret, b"rank", challenge))
            mine = os.urandom(_CHALLENGE_BYTES)
            self.send_bytes(mine)
            answer = self.recv_bytes(limit=_HANDSHAKE_FRAME)
            if not hmac.compare_digest(answer, _digest(secret, b"controller", mine)):
                raise AuthError("controller failed authentication (wrong secret?)")
            self._share_as_client()
        except (OSError, struct.error) as exc:
            raise AuthError(f"handshake failed: {exc}") from None
        finally:
            self.sock.settimeout(None)

    # -- shared memory (after authentication: only an authenticated peer names a file) -------
    def _share_as_server(self, allowed: bool) -> None:
        """The rank offers its file; if we can read it we offer ours; it confirms it reads ours."""
        offer = self.recv_bytes(limit=_HANDSHAKE_FRAME)
        side = _new_side() if allowed and offer else None
        if side is not None and not side.open_peer(offer):
            side.close()
            side = None
        try:
            self.send_bytes(side.probe if side is not None else b"")
            if side is None:
                return
            if self.recv_bytes(limit=_HANDSHAKE_FRAME) != b"1":
                side.close()
                return
        except BaseException:
            if side is not None:
                side.close()
            raise
        side.agreed(offer)
        self.shm = side

    def _share_as_client(self) -> None:
        side = _new_side()
        try:
            self.send_bytes(side.probe if side is not None else b"")
            reply = self.recv_bytes(limit=_HANDSHAKE_FRAME)
            if not reply:
                if side is not None:
                    side.close()
                return
            ok = side is not None and side.open_peer(reply)
            self.send_bytes(b"1" if ok else b"0")
        except BaseException:
            if side is not None:
                side.close()
            raise
        if not ok:
            if side is not None:
                side.close()
            return
        assert side is not None
        side.agreed(reply)
        self.shm = side


def _new_side() -> shm.SharedSide | None:
    """Our end of shared memory, or None (no ``/dev/shm`` here, or it refuses a file)."""
    if not shm.available():
        return None
    try:
        return shm.SharedSide()
    except OSError:
        return None


def connect(host: str, port: int, secret: bytes, timeout_s: float = 30.0) -> Channel:
    """Connect to the controller and authenticate both ways."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.settimeout(None)
    channel = Channel(sock)
    try:
        channel.authenticate_as_client(secret)
    except Exception:
        channel.close()
        raise
    return channel


class Listener:
    """The controller's listening socket; loopback unless told otherwise."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.host, self.port = self.sock.getsockname()[:2]

    def accept(self, timeout_s: float | None = None) -> socket.socket:
        self.sock.settimeout(timeout_s)
        conn, _ = self.sock.accept()
        conn.settimeout(None)
        return conn

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
