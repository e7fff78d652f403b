"""The rendezvous store listens only on the address it is given (torch's TCPStore server alone
binds every interface)."""

from __future__ import annotations

import socket
import threading
import time

import psutil
import pytest
import torch.distributed as dist

from flodl.runtime.wire.store import serve_store


def _listening(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_a_loopback_store_is_not_reachable_from_other_interfaces():
    store = serve_store("127.0.0.1")
    try:
        assert _listening(store.port) == {"127.0.0.1"}
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, use_libuv=False)
        client.set("k", "v")
        assert store.get("k") == b"v"
        del client
    finally:
        del store


def test_a_busy_port_is_an_os_error_not_a_pybind_message():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError):
            serve_store("127.0.0.1", taken.getsockname()[1])


def _signed(secret: bytes = b"s" * 32, timeout_s: float = 2.0):
    from flodl.runtime.wire.signed_store import SignedStore

    inner = dist.HashStore()
    return inner, SignedStore(inner, secret, timeout_s)


def test_signed_values_round_trip_and_are_unreadable_as_plain_values():
    inner, store = _signed()
    store.set("addr", b"10.0.0.1:1234")
    assert store.get("addr") == b"10.0.0.1:1234"
    assert inner.get("addr") != b"10.0.0.1:1234"  # a MAC travels with it
    _, other_run = _signed(b"t" * 32)
    other_run._inner = inner  # the same store, another run's secret: the value is refused
    other_run._timeout_s = 0.1
    with pytest.raises(PermissionError, match="addr"):
        other_run.get("addr")


def test_planted_garbage_waits_for_the_genuine_value():
    inner, store = _signed()
    inner.set("peer", b"\x00garbage\xff" * 10)  # a stranger got there first
    threading.Timer(0.3, store.set, args=("peer", b"real")).start()
    t0 = time.monotonic()
    assert store.get("peer") == b"real"
    assert time.monotonic() - t0 >= 0.25


def test_garbage_that_stays_is_named_after_the_timeout():
    inner, store = _signed(timeout_s=0.3)
    inner.set("peer", b"short")
    with pytest.raises(PermissionError, match="not signed with this run's secret"):
        store.get("peer")


def test_a_blocking_read_gives_up_once_doomed_and_waits_otherwise():
    """gloo's exchange of addresses reads through this store: a peer killed while the group
    forms never writes its key, and the read must end once a newer membership is announced
    (was: until the store's timeout, start_timeout_s)."""
    import threading
    import time
    from datetime import timedelta

    from flodl.runtime.wire.signed_store import GivenUp, SignedStore

    doomed = threading.Event()
    store = SignedStore(dist.HashStore(), b"s" * 32, timeout_s=30.0, doomed=doomed.is_set)
    threading.Timer(0.3, doomed.set).start()
    t0 = time.monotonic()
    with pytest.raises(GivenUp):
        store.get("rank_1")
    with pytest.raises(GivenUp):
        store.wait(["rank_1"], timedelta(seconds=30))
    assert time.monotonic() - t0 < 5.0
    alive = SignedStore(dist.HashStore(), b"s" * 32, timeout_s=30.0, doomed=lambda: False)
    threading.Timer(0.2, alive.set, ("rank_1", b"addr")).start()
    assert alive.get("rank_1") == b"addr"  # a value that comes is waited for
    with pytest.raises(TimeoutError):
        alive.wait(["rank_2"], timedelta(seconds=0.3))
