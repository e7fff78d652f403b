"""The rendezvous store listens only on the address it is given (torch's TCPStore server alone
binds every interface)."""

from __future__ import annotations

import socket

import psutil
import pytest
import torch.distributed as dist

from flodl.runtime.store import serve_store


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
