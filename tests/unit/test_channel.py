"""The control plane on loopback: mutual HMAC auth, bounded frames, garbage rejected."""

from __future__ import annotations

import socket
import threading

import pytest

from flodl.runtime.wire.channel import AuthError, Channel, FrameError, Listener, connect, new_secret


def _serve_once(listener: Listener, secret: bytes, out: dict) -> threading.Thread:
    def run() -> None:
        sock = listener.accept(timeout_s=10)
        channel = Channel(sock)
        try:
            channel.authenticate_as_server(secret)
            out["msg"] = channel.recv()
            channel.send({"echo": out["msg"]})
        except Exception as exc:
            out["error"] = exc
        finally:
            channel.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_authenticated_round_trip():
    secret = new_secret()
    listener = Listener()
    out: dict = {}
    thread = _serve_once(listener, secret, out)
    client = connect(listener.host, listener.port, secret)
    client.send({"hello": 1})
    assert client.recv() == {"echo": {"hello": 1}}
    thread.join(5)
    client.close()
    listener.close()
    assert listener.host == "127.0.0.1"


def test_wrong_secret_is_rejected_by_both_sides():
    listener = Listener()
    out: dict = {}
    thread = _serve_once(listener, new_secret(), out)
    with pytest.raises(AuthError):
        connect(listener.host, listener.port, new_secret())
    thread.join(5)
    listener.close()
    assert isinstance(out.get("error"), AuthError)
    assert "msg" not in out  # nothing was ever unpickled from the impostor


def test_garbage_bytes_never_reach_pickle():
    listener = Listener()
    out: dict = {}
    thread = _serve_once(listener, new_secret(), out)
    raw = socket.create_connection((listener.host, listener.port))
    raw.sendall(b"GET / HTTP/1.1\r\n\r\n" * 10)
    thread.join(10)
    raw.close()
    listener.close()
    assert isinstance(out.get("error"), AuthError)


def test_oversized_frame_is_refused_before_allocation():
    a, b = socket.socketpair()
    sender, receiver = Channel(a), Channel(b, max_frame=1024)
    sender.send_bytes(b"x" * 2048)
    with pytest.raises(FrameError, match="exceeds the 1024 bound"):
        receiver.recv_bytes()
    with pytest.raises(FrameError):
        Channel(a, max_frame=10).send_bytes(b"y" * 11)
    sender.close()
    receiver.close()


def test_silent_peer_times_out_of_the_handshake(monkeypatch):
    import flodl.runtime.wire.channel as channel_mod

    monkeypatch.setattr(channel_mod, "HANDSHAKE_TIMEOUT_S", 0.3)
    a, b = socket.socketpair()
    with pytest.raises(AuthError):
        Channel(a).authenticate_as_server(new_secret())
    a.close()
    b.close()


def _pair(max_frame: int) -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a, max_frame=max_frame), Channel(b, max_frame=max_frame)


def test_tensors_larger_than_the_frame_bound_stream_through(monkeypatch):
    import torch

    from flodl.runtime.wire import streaming

    monkeypatch.setattr(streaming, "CHUNK_BYTES", 4096)
    sender, receiver = _pair(max_frame=8192)
    frames: list[int] = []
    real = sender._frame
    monkeypatch.setattr(sender, "_frame", lambda m, d: (frames.append(len(d)), real(m, d)))
    big = torch.randn(50_000)  # 200 kB: 25x the frame bound
    msg = {
        "w": big,
        "view": big[7:19],
        "p": torch.nn.Parameter(torch.ones(3)),
        "empty": torch.zeros(0, 4),
        "flags": torch.tensor([True, False]),
        "text": "t" * 20_000,  # a skeleton above the bound is chunked too
    }
    out: dict = {}
    reader = threading.Thread(target=lambda: out.update(msg=receiver.recv()), daemon=True)
    reader.start()
    sender.send(msg)
    reader.join(10)
    got = out["msg"]
    assert torch.equal(got["w"], big) and got["w"] is not big
    assert got["view"].tolist() == big[7:19].tolist()  # only the view's bytes travelled
    assert isinstance(got["p"], torch.nn.Parameter) and got["p"].tolist() == [1.0, 1.0, 1.0]
    assert got["empty"].shape == (0, 4) and got["flags"].tolist() == [True, False]
    assert got["text"] == msg["text"]
    assert max(frames) <= 4096 + 200  # every frame bounded (the head frame is small)
    assert sum(frames) < 200_000 + 20_000 + 1000  # each tensor's bytes sent once
    sender.close()
    receiver.close()


def test_a_streamed_message_cut_by_a_foreign_frame_is_refused():
    import pickle

    sender, receiver = _pair(max_frame=1024)
    sender._frame(b"FDL2", pickle.dumps((10, [])))
    sender._frame(b"FDL2", b"x" * 10)  # not a continuation frame
    with pytest.raises(FrameError, match="interrupted"):
        receiver.recv()
    sender.close()
    receiver.close()


def test_code_messages_stream_their_tensors_too(monkeypatch):
    """The job spec (cloudpickle: closures) with a dataset passed as an object, past the bound."""
    import torch

    sender, receiver = _pair(max_frame=8192)
    data = torch.arange(40_000, dtype=torch.float32)
    offset = 3.0
    spec = {"dataset": torch.utils.data.TensorDataset(data), "fn": lambda x: x + offset}
    out: dict = {}
    reader = threading.Thread(target=lambda: out.update(msg=receiver.recv()), daemon=True)
    reader.start()
    sender.send_code(spec)
    reader.join(10)
    got = out["msg"]
    assert torch.equal(got["dataset"].tensors[0], data) and got["fn"](1.0) == 4.0
    sender.close()
    receiver.close()


def test_the_rank_link_keeps_no_received_tensor_while_it_awaits_the_next() -> None:
    """A rank's reader thread must not pin the last message (an Average: a copy of the weights)
    through the next window: once the training thread dropped it, it is freed."""
    import gc
    import time
    import weakref

    import torch

    from flodl.runtime.wire.messages import Average
    from flodl.runtime.wire.rank_link import SocketLink

    a, b = socket.socketpair()
    controller, rank_end = Channel(a), Channel(b)
    link = SocketLink(rank_end, rank=0, in_launcher=True)
    try:
        controller.send(Average(3, torch.ones(1000)))
        msg = link.recv(timeout=10)
        assert msg.window == 3 and float(msg.flat.sum()) == 1000.0
        freed = weakref.ref(msg.flat)
        del msg
        deadline = time.monotonic() + 5
        while freed() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        assert freed() is None
    finally:
        link.close()
        controller.close()


def test_a_rank_link_beats_well_inside_a_short_heartbeat_timeout() -> None:
    """heartbeat_timeout_s=0.4: the rank's link beats every 0.1 s, not every second (a beat
    every 1 s against a timeout under 1 s would drop every healthy rank that trains quietly)."""
    import itertools
    import time

    from flodl.runtime.wire.messages import Heartbeat
    from flodl.runtime.wire.rank_link import SocketLink, beat_interval_s

    assert beat_interval_s(30.0) == 1.0 and beat_interval_s(0.4) == pytest.approx(0.1)
    a, b = socket.socketpair()
    controller, rank_end = Channel(a), Channel(b)
    link = SocketLink(rank_end, rank=0, in_launcher=True, beat_s=beat_interval_s(0.4))
    arrivals = []
    try:
        a.settimeout(5)
        while len(arrivals) < 5:
            msg = controller.recv()
            assert isinstance(msg, Heartbeat) and msg.rank == 0
            arrivals.append(time.monotonic())
    finally:
        link.close()
        controller.close()
    gaps = [t1 - t0 for t0, t1 in itertools.pairwise(arrivals)]
    assert max(gaps) < 0.4, gaps  # every gap inside the timeout


def test_a_control_frame_is_one_system_call_and_a_bulk_frame_is_not_copied() -> None:
    """A plan goes to every rank each window: its header and body leave in one ``sendall``.
    A frame over the join bound is sent from where it lies (no copy of a tensor's bytes)."""
    from flodl.runtime.wire import channel as channel_mod

    a, b = socket.socketpair()
    calls: list[int] = []

    class Counting:
        def sendall(self, data: bytes | memoryview) -> None:
            calls.append(len(data))
            a.sendall(data)

    sender = Channel(a)
    sender.sock = Counting()  # type: ignore[assignment]
    receiver = Channel(b)
    small = b"p" * 1500
    sender.send_bytes(small)
    assert calls == [channel_mod._HEADER.size + len(small)]
    assert receiver.recv_bytes() == small
    calls.clear()
    big = memoryview(bytearray(channel_mod._JOIN_BELOW + 1))
    done = threading.Thread(target=lambda: sender.send_bytes(big), daemon=True)
    done.start()
    assert receiver.recv_bytes() == big
    done.join(5)
    assert calls == [channel_mod._HEADER.size, len(big)]
    a.close()
    b.close()
