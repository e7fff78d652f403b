"""The control plane on loopback: mutual HMAC auth, bounded frames, garbage rejected."""

from __future__ import annotations

import socket
import threading

import pytest

from flodl.runtime.channel import AuthError, Channel, FrameError, Listener, connect, new_secret


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
    import flodl.runtime.channel as channel_mod

    monkeypatch.setattr(channel_mod, "HANDSHAKE_TIMEOUT_S", 0.3)
    a, b = socket.socketpair()
    with pytest.raises(AuthError):
        Channel(a).authenticate_as_server(new_secret())
    a.close()
    b.close()
