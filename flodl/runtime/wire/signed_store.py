"""Rendezvous values signed with the run's secret, so a stranger's writes never reach gloo."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import Store

_MAC_BYTES = 32
_FORGED_POLL_S = 0.05
_POLL_S = 0.05


class GivenUp(RuntimeError):
    """A rendezvous read given up: ``doomed()`` said the membership it was for is gone."""


def _store_key(secret: bytes) -> bytes:
    """The key that signs rendezvous values: derived from the per-run secret on each side, so it
    never travels (the control-plane secret itself signs nothing here)."""
    return hmac.new(secret, b"flodl rendezvous store", hashlib.sha256).digest()


class SignedStore(Store):
    """A store whose values carry an HMAC of the run's secret, checked on every read.

    torch's ``TCPStore`` has no authentication: on a multi-host run anyone who reaches its port can
    list, write and delete keys. Written through this wrapper, every value gloo's rendezvous
    publishes is signed; a value without a valid signature is treated as not there yet (the
    genuine writer's ``set`` replaces planted garbage) until the store's timeout, then named in a
    :class:`PermissionError`. Garbage therefore never reaches gloo's parser (it used to kill every
    rank); a stranger can still delay a rendezvous by deleting or overwriting a key between its
    write and its read, which the regroup's timeout bounds.

    ``doomed``: reads that would block (a peer's address that gloo waits for while it connects
    the group) are polled in short slices and given up (:class:`GivenUp`) once it says the
    membership they are for is gone — a peer killed in the middle of forming the group never
    writes its key, and gloo would wait for it until the store's timeout.
    """

    def __init__(
        self,
        inner: Any,
        secret: bytes,
        timeout_s: float = 300.0,
        doomed: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._key = _store_key(secret)
        self._timeout_s = timeout_s
        self._doomed = doomed

    def _await(self, keys: list[str], timeout_s: float) -> None:
        """Until ``keys`` are all set; :class:`GivenUp` once doomed; ``TimeoutError`` after
        ``timeout_s`` (a blocking wait of the inner store when nothing can doom it)."""
        if self._doomed is None:
            self._inner.wait(keys, timedelta(seconds=timeout_s))
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:  # returns the moment the keys are set: no latency added to a formation
                self._inner.wait(keys, timedelta(seconds=_POLL_S))
                return
            except RuntimeError:  # this slice's timeout (DistStoreError)
                pass
            if self._doomed():
                raise GivenUp(f"rendezvous keys {keys} given up: the membership changed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous keys {keys} not set within {timeout_s:.0f} s")

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._mac(key, data) + data)

    def get(self, key: str) -> bytes:
        self._await([key], self._timeout_s)
        deadline = time.monotonic() + self._timeout_s
        while True:
            raw = bytes(self._inner.get(key))
            mac, data = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
            if len(raw) >= _MAC_BYTES and hmac.compare_digest(mac, self._mac(key, data)):
                return data
            if time.monotonic() > deadline:
                raise PermissionError(
                    f"rendezvous key {key!r} holds a value not signed with this run's secret: "
                    "someone who can reach the store's port wrote to it"
                )
            time.sleep(_FORGED_POLL_S)

    def add(self, key: str, amount: int) -> int:  # counters cannot be signed; gloo uses none
        return int(self._inner.add(key, amount))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(keys, self._timeout_s if timeout is None else timeout.total_seconds())

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
        self._inner.set_timeout(timeout)
