"""cpu_* snapshots summed while they arrive (flodl/runtime/controller/sums.py): the mean equals the
weighted mean of whole snapshots, nothing is allocated per rank, and a cut-off snapshot taints
its window instead of corrupting the average."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from flodl.elche import averaging_weights, buffer_weights
from flodl.runtime.controller import sums
from flodl.runtime.controller.sums import SnapshotSums
from flodl.runtime.sync.averaging import weighted_mean
from flodl.runtime.wire import channel as channel_module
from flodl.runtime.wire import streaming
from flodl.runtime.wire.channel import Channel
from flodl.runtime.wire.messages import Report

N, N_PARAMS = 10_000, 9_000


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    # many pieces and frames (and lock cells) for a small vector; frames not piece-aligned
    monkeypatch.setattr(channel_module, "PIECE_BYTES", 4096)
    monkeypatch.setattr(sums, "PIECE_BYTES", 4096)
    monkeypatch.setattr(streaming, "CHUNK_BYTES", 6000 * 4)


def _report(rank: int, samples: int, batches: int, snapshot) -> Report:
    return Report(rank, 3, 0, ((0, samples),), batches, samples, 1.0, 0.0, 0, snapshot=snapshot)


def _pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a), Channel(b)


def _receive(receiver: Channel, total: SnapshotSums, out: list) -> threading.Thread:
    def read() -> None:
        try:
            out.append(receiver.recv(route=total.route))
        except ConnectionError as exc:
            out.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_streamed_snapshots_sum_to_the_weighted_mean_without_a_copy_per_rank():
    total = SnapshotSums(gamma=1.0)
    total.n_params = N_PARAMS
    snaps = [torch.randn(N) for _ in range(3)]
    samples, batches = [96, 32, 0], [3, 1, 0]  # rank 2 did not step: weight 0 everywhere
    pairs = [_pair() for _ in snaps]
    got: list[list] = [[] for _ in snaps]
    readers = [_receive(rx, total, got[i]) for i, (_, rx) in enumerate(pairs)]
    senders = [
        threading.Thread(target=tx.send, args=(_report(i, samples[i], batches[i], snaps[i]),))
        for i, (tx, _) in enumerate(pairs)
    ]
    for t in senders:
        t.start()
    for t in senders + readers:
        t.join(10)
    assert all(g[0].snapshot is None and g[0].samples == samples[i] for i, g in enumerate(got))
    mean = total.take(3, [0, 1, 2])
    expected = weighted_mean(
        [s.clone() for s in snaps],
        averaging_weights(samples, 1.0),
        buffer_weights(batches),
        N_PARAMS,
    )
    assert mean is not None and torch.allclose(mean, expected, atol=1e-6)
    assert total.take(3, [0, 1, 2]) is None  # taken once: the sum is gone


def test_a_snapshot_arriving_whole_joins_the_streamed_ones():
    total = SnapshotSums(gamma=0.0)
    total.n_params = N_PARAMS
    a, b = torch.randn(N), torch.randn(N)
    tx, rx = _pair()
    got: list = []
    reader = _receive(rx, total, got)
    tx.send(_report(0, 64, 2, a))
    reader.join(10)
    total.add_whole(_report(1, 32, 1, b))  # an in-process rank's report
    mean = total.take(3, [0, 1])
    assert mean is not None and torch.allclose(mean, (a + b) / 2, atol=1e-6)  # gamma 0: equal


def test_a_snapshot_cut_off_half_way_taints_its_window():
    total = SnapshotSums(gamma=1.0)
    total.n_params = N_PARAMS
    tx, rx = _pair()
    got: list = []
    reader = _receive(rx, total, got)
    skeleton, tensors = streaming.split(_report(0, 64, 2, torch.randn(N)))
    whole = []  # capture the frames, then replay only the first half of them
    tx._frame = lambda magic, data: whole.append((magic, bytes(data)))  # type: ignore[method-assign]
    tx.send(_report(0, 64, 2, torch.randn(N)))
    for magic, data in whole[: len(whole) // 2]:
        Channel._frame(tx, magic, data)
    tx.close()
    reader.join(10)
    assert isinstance(got[0], ConnectionError)
    assert total.take(3, [0]) is None  # partly summed: averages nothing
    assert skeleton and tensors  # (the message does stream its snapshot)
