"""The data plane's rendezvous store, listening only on the address it is asked for.

torch's ``TCPStore`` server binds every interface whatever host it is given, and it has no
authentication: on a single-host run anyone on the network could read, write or delete the keys
the ranks rendezvous on (garbage written there killed every rank). The store is therefore handed
a socket already bound to the controller's address (``master_listen_fd``, the mechanism
torchelastic uses), so a loopback run's store is reachable from this machine only.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def serve_store(host: str, port: int = 0, timeout_s: float = 300.0) -> Any:
    """A master ``TCPStore`` listening on ``host:port`` only (port 0: a free one)."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        bound_port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store owns the descriptor from here (it closes it when destroyed): detach, so Python
    # never closes a number the store may still use.
    return TCPStore(
        host,
        bound_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),
        use_libuv=False,
    )


def shared_store(host: str, port: int, serve: bool, timeout_s: float) -> Any:
    """A store other jobs share (torchrun's at ``MASTER_ADDR:MASTER_PORT``): ``serve`` on the
    rank that hosts it when torchrun's agent does not; many clients per process."""
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        port,
        is_master=serve,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
        use_libuv=False,
    )


def rendezvous_store(host: str, port: int, world_size: int, serve: bool, timeout_s: float) -> Any:
    """The bypass tier's store (:class:`flodl.ddp.Rendezvous`): ``world_size`` ranks meet at
    ``host:port``; the one that ``serve`` hosts it."""
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        port,
        world_size=world_size,
        is_master=serve,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        use_libuv=False,
    )


def join_store(
    host: str,
    port: int,
    secret: bytes,
    prefix: str,
    timeout_s: float = 300.0,
    doomed: Callable[[], bool] | None = None,
) -> Any:
    """A rank's view of the launcher's store: ``prefix``'s keys, values signed with ``secret``;
    blocking reads given up once ``doomed()`` (:mod:`flodl.runtime.wire.signed_store`)."""
    from torch.distributed import PrefixStore, TCPStore

    from flodl.runtime.wire.signed_store import SignedStore

    store = TCPStore(host, port, is_master=False, use_libuv=False)
    return SignedStore(PrefixStore(prefix, store), secret, timeout_s, doomed)
