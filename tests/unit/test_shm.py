"""The control channel's shared-memory side: negotiated in the handshake, tensors through
/dev/shm (mapped, no copy), one message in a file at a time, TCP whenever that cannot hold."""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import threading
import time

import pytest
import torch

from flodl.runtime.wire import shm
from flodl.runtime.wire.channel import Channel, FrameError, new_secret

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")


def _names() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"{shm.PREFIX}{os.getpid()}-")}


def _pair(shared_memory: bool = True) -> tuple[Channel, Channel]:
    """(launcher end, rank end), authenticated over a socket pair like a real rank."""
    a, b = socket.socketpair()
    server, client = Channel(a), Channel(b)
    secret = new_secret()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            server.authenticate_as_server(secret, shared_memory=shared_memory)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    client.authenticate_as_client(secret)
    thread.join(10)
    assert not errors
    return server, client


def _recv_in_thread(channel: Channel, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["msg"] = channel.recv(**kwargs)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _await(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return predicate()


def _count_frames(monkeypatch, channel: Channel) -> list[int]:
    sizes: list[int] = []
    real = channel._frame
    monkeypatch.setattr(channel, "_frame", lambda m, d: (sizes.append(len(d)), real(m, d))[1])
    return sizes


def test_one_host_negotiates_shared_memory_and_leaves_no_names():
    before = _names()
    server, client = _pair()
    try:
        assert server.shm is not None and client.shm is not None
        assert set(server.shm.peer) == {0} and set(client.shm.peer) == {0}
        assert _names() == before  # each side unlinked the other's name once it had it open
    finally:
        server.close()
        client.close()
    assert _names() == before


def test_tensors_travel_through_shared_memory_not_the_socket(monkeypatch):
    server, client = _pair()
    sizes = _count_frames(monkeypatch, client)
    big = torch.randn(1_000_000)
    msg = {
        "w": big,
        "view": big[7:19],
        "p": torch.nn.Parameter(torch.ones(3)),
        "empty": torch.zeros(0, 4),
        "flags": torch.tensor([True, False]),
        "half": torch.arange(10, dtype=torch.bfloat16),
        "text": "t" * 1000,
    }
    thread, out = _recv_in_thread(server)
    client.send(msg)
    thread.join(10)
    got = out["msg"]
    assert torch.equal(got["w"], big) and got["w"].data_ptr() != big.data_ptr()
    assert got["view"].tolist() == big[7:19].tolist()
    assert isinstance(got["p"], torch.nn.Parameter) and got["p"].tolist() == [1.0, 1.0, 1.0]
    assert got["empty"].shape == (0, 4) and got["flags"].tolist() == [True, False]
    assert torch.equal(got["half"], msg["half"]) and got["text"] == msg["text"]
    assert client.shm.sent == 1 and server.shm.received == 1
    assert sum(sizes) < 10_000  # the socket carried the skeleton only (4 MB went by /dev/shm)
    # The receiver owns what it got: changing it (copy-on-write) leaves the sender's file alone.
    got["w"].zero_()
    assert float(got["w"].abs().sum()) == 0.0 and float(big.abs().sum()) > 0
    server.close()
    client.close()


def test_a_file_is_reused_only_once_the_receiver_dropped_its_message():
    """Messages the receiver keeps each hold a file; past MAX_FILES they go over TCP; a file
    whose message was dropped (a view of it too) is acknowledged and taken again."""
    server, client = _pair()
    sent = [torch.full((500_000,), float(v)) for v in range(shm.MAX_FILES + 2)]
    held = []
    try:
        for v in range(shm.MAX_FILES + 1):
            thread, out = _recv_in_thread(client)
            server.send({"avg": sent[v]})
            thread.join(10)
            held.append(out.pop("msg")["avg"])
        # every file holds a message the rank still references: the last one went by TCP
        assert server.shm.sent == shm.MAX_FILES == len(server.shm.files)
        assert client.shm.received == shm.MAX_FILES
        assert all(
            torch.equal(h, t) for h, t in zip(held, sent[: len(held)], strict=True)
        )  # none was overwritten
        assert not _names()  # every file's name was removed once the rank had opened it
        view = held[1][10:20]  # a view keeps its mapping (and the file) alive too
        del held[:3]
        gc.collect()
        time.sleep(0.1)
        _recv_in_thread(server)  # the launcher's reader takes the acknowledgements
        assert _await(lambda: server.shm.files[0].free and server.shm.files[2].free)
        assert not server.shm.files[1].free
        thread, out = _recv_in_thread(client)
        server.send({"avg": sent[-1]})
        thread.join(10)
        assert server.shm.sent == shm.MAX_FILES + 1 and client.shm.received == shm.MAX_FILES + 1
        assert torch.equal(out["msg"]["avg"], sent[-1]) and float(view[0]) == 1.0
    finally:
        server.close()
        client.close()


def test_a_consumed_tensor_is_handed_on_in_pieces_and_freed_at_once():
    """The launcher's route (a cpu_* snapshot summed as it arrives): pieces within the lock
    grid, every byte once, and the rank's file free again as soon as the reader is done."""
    from flodl.runtime.wire.channel import PIECE_BYTES

    server, client = _pair()
    snapshot = torch.randn((PIECE_BYTES * 2 + 1000) // 4)
    total = torch.zeros_like(snapshot)
    pieces: list[tuple[int, int]] = []

    def consume(offset: int, piece: memoryview) -> None:
        pieces.append((offset, len(piece)))
        lo = offset // 4
        total[lo : lo + len(piece) // 4] += torch.frombuffer(piece, dtype=torch.float32)

    def route(msg, descriptors):
        return {msg["snap"].index: consume}

    try:
        thread, out = _recv_in_thread(server, route=route)
        client.send({"snap": snapshot, "other": torch.ones(5)})
        thread.join(20)
        assert out["msg"]["snap"] is None and out["msg"]["other"].tolist() == [1.0] * 5
        assert torch.equal(total, snapshot)
        assert all(o // PIECE_BYTES == (o + n - 1) // PIECE_BYTES for o, n in pieces)
        assert sum(n for _, n in pieces) == snapshot.numel() * 4
        del out
        _recv_in_thread(client)
        assert _await(lambda: client.shm.files[0].free)
    finally:
        server.close()
        client.close()


def test_the_launcher_can_refuse_and_then_everything_goes_over_tcp(monkeypatch):
    before = _names()
    server, client = _pair(shared_memory=False)
    try:
        assert server.shm is None and client.shm is None
        assert _names() == before
        sizes = _count_frames(monkeypatch, client)
        thread, out = _recv_in_thread(server)
        client.send({"w": torch.ones(1_000_000)})
        thread.join(10)
        assert float(out["msg"]["w"].sum()) == 1_000_000.0 and sum(sizes) > 4_000_000
    finally:
        server.close()
        client.close()


def test_a_peer_that_cannot_see_our_file_keeps_the_channel_on_tcp(monkeypatch):
    """Another host, or another container's /dev/shm: the token cannot be read back."""
    before = _names()
    monkeypatch.setattr(shm.SharedSide, "open_peer", lambda self, probe: False)
    server, client = _pair()
    try:
        assert server.shm is None and client.shm is None
        assert _names() == before  # both sides removed their files
    finally:
        server.close()
        client.close()


def test_a_probe_is_believed_only_for_our_own_file_with_its_token(tmp_path):
    side, other = shm.SharedSide(), shm.SharedSide()
    try:
        path, token = other.probe.split(b"\0")
        assert not side.open_peer(path + b"\0" + b"00" * 16)  # wrong token
        assert not side.open_peer(b"/etc/passwd\0" + token)  # not in /dev/shm
        assert not side.open_peer(path + b"-gone\0" + token)  # no such file
        outside = tmp_path / os.path.basename(path.decode())
        outside.write_bytes(other.token)
        assert not side.open_peer(str(outside).encode() + b"\0" + token)
        assert not side.open_peer(b"garbage")
        assert side.open_peer(other.probe)
    finally:
        side.close()
        other.close()


def test_a_failed_write_turns_shared_memory_off_and_the_message_still_arrives(monkeypatch, caplog):
    server, client = _pair()

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "pwrite", full)
    try:
        thread, out = _recv_in_thread(server)
        with caplog.at_level(logging.WARNING, logger="flodl.runtime.wire.shm"):
            client.send({"w": torch.arange(1_000_000, dtype=torch.float32)})
        thread.join(10)
        assert torch.equal(out["msg"]["w"], torch.arange(1_000_000, dtype=torch.float32))
        assert not client.shm.enabled and client.shm.sent == 0
        assert "No space left" in caplog.text and "over TCP" in caplog.text
    finally:
        server.close()
        client.close()


def test_a_region_outside_the_peer_file_is_refused_before_it_is_mapped():
    import pickle

    from flodl.runtime.wire import streaming

    server, client = _pair()
    try:
        skeleton, tensors = streaming.split({"w": torch.ones(4)})
        described = streaming.describe(tensors)
        for where, why in [
            (([1 << 40], 0, None), "outside the peer's shared file"),  # past the file's end
            (([0], 2, None), "never announced"),  # a file the peer never named
            (([0], 1, "/etc/passwd"), "outside /dev/shm"),
            (([0], 1, "/dev/shm/not-ours"), "outside /dev/shm"),
        ]:
            client._frame(b"FDL3", pickle.dumps((len(skeleton), described, *where)))
            client._frame(b"FDL1", skeleton)
            with pytest.raises(FrameError, match=why):
                server.recv()
    finally:
        server.close()
        client.close()


def test_a_shared_memory_frame_without_negotiation_is_refused():
    import pickle

    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b)
    sender._frame(b"FDL3", pickle.dumps((0, [], [])))
    with pytest.raises(FrameError, match="without shared memory"):
        receiver.recv()
    sender.close()
    receiver.close()
    a, b = socket.socketpair()  # a refused frame ends the channel: a fresh one for the next
    sender, receiver = Channel(a), Channel(b)
    sender._frame(b"FDL4", b"")
    with pytest.raises(FrameError, match="acknowledgement"):
        receiver.recv()
    sender.close()
    receiver.close()


def test_a_close_during_use_waits_for_the_user_before_closing_the_descriptors(monkeypatch):
    """Teardown closes a channel while a sender may be inside pwrite: its descriptor must not
    be closed (and its number reused for another file) under it."""
    side = shm.SharedSide()
    closed: list[float] = []
    real = side._close_descriptors
    monkeypatch.setattr(side, "_close_descriptors", lambda: (closed.append(1), real())[1])
    with side.using():
        side.close()
        assert not closed and side.claim(10) is None  # closing: nothing new starts
        os.fstat(side.files[0].fd)  # still open
    assert closed == [1]
    with pytest.raises(OSError, match="closed"), side.using():
        pass
    side.close()  # idempotent
    assert closed == [1]


def test_a_forked_child_dropping_a_message_acknowledges_nothing(monkeypatch):
    """A DataLoader worker forked from a rank holds a copy of the rank's objects: if it drops a
    received average, the ack must not go out on the rank's socket from the child."""
    server, client = _pair()
    try:
        thread, out = _recv_in_thread(client)
        server.send({"avg": torch.ones(500_000)})
        thread.join(10)
        monkeypatch.setattr(client.shm, "pid", -1)  # as seen from a forked child
        del out
        gc.collect()
        _recv_in_thread(server)
        time.sleep(0.3)
        assert not server.shm.files[0].free and not client._acks_owed
    finally:
        server.close()
        client.close()


def test_closing_removes_every_name_of_ours_the_peer_never_opened():
    """A file named in a message the peer never read (it was killed, or the run ended first)
    would otherwise stay in /dev/shm, holding its memory, until the machine reboots."""
    before = _names()
    server, client = _pair()
    held = []
    try:
        for _ in range(2):  # the second message takes a second file, named in its head only
            thread, out = _recv_in_thread(client)
            server.send({"avg": torch.ones(500_000)})
            thread.join(10)
            held.append(out["msg"])
        server.shm.claim(1)  # a third file, made for a message that never went out
        assert len(server.shm.files) == 3 and len(_names()) == 1
    finally:
        server.close()
        client.close()
    assert _names() == before


def test_the_launcher_sweeps_what_a_killed_rank_left(tmp_path):
    pid = 4_000_000  # no such process: its names are what a killed rank left
    for i in range(2):
        open(os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{pid}-{i:016x}"), "wb").close()
    keep = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{pid}1-0000000000000000")  # another pid
    open(keep, "wb").close()
    try:
        assert shm.sweep(pid) == 2
        assert os.path.exists(keep)
    finally:
        os.unlink(keep)
