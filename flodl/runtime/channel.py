"""The control plane: length-prefixed frames over TCP, mutually authenticated with a per-run secret.

Handshake (HMAC-SHA256 challenge/response, both directions) happens before a single byte is
unpickled: an unauthenticated peer can only ever make us read a bounded, fixed-size frame, and
is dropped on the first wrong byte. After the handshake, frames carry pickled messages, bounded by
``max_frame`` so a confused peer cannot make us allocate without limit. The secret travels to
ranks on stdin, never on a command line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import struct
import threading
from typing import Any

import cloudpickle

_HEADER = struct.Struct("!4sQ")
_MAGIC = b"FDL1"
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

    def send_bytes(self, payload: bytes) -> None:
        if len(payload) > self.max_frame:
            raise FrameError(f"frame of {len(payload)} bytes exceeds the {self.max_frame} bound")
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(_MAGIC, len(payload)) + payload)

    def recv_bytes(self, limit: int | None = None) -> bytes:
        magic, size = _HEADER.unpack(self._recv_exact(_HEADER.size))
        if magic != _MAGIC:
            raise FrameError("bad frame magic (not a flodl peer)")
        bound = self.max_frame if limit is None else limit
        if size > bound:
            raise FrameError(f"frame of {size} bytes exceeds the {bound} bound")
        return self._recv_exact(size)

    # -- messages (only after authentication) -----------------------------------------------
    def send(self, msg: Any) -> None:
        self.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def send_code(self, obj: Any) -> None:
        """Send an object that may hold closures or ``__main__`` functions (cloudpickle)."""
        self.send_bytes(cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        return pickle.loads(self.recv_bytes())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # -- handshake --------------------------------------------------------------------------
    def authenticate_as_server(self, secret: bytes) -> None:
        """Challenge the peer, then answer its challenge. Raises :class:`AuthError`."""
        self.sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            challenge = os.urandom(_CHALLENGE_BYTES)
            self.send_bytes(challenge)
            answer = self.recv_bytes(limit=_HANDSHAKE_FRAME)
            if not hmac.compare_digest(answer, _digest(secret, b"rank", challenge)):
                raise AuthError("peer failed authentication")
            theirs = self.recv_bytes(limit=_HANDSHAKE_FRAME)
            self.send_bytes(_digest(secret, b"controller", theirs))
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
        except (OSError, struct.error) as exc:
            raise AuthError(f"handshake failed: {exc}") from None
        finally:
            self.sock.settimeout(None)


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
