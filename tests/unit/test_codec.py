"""Compressed averaging through the controller (flodl/runtime/sync/codec.py, the packed path of
flodl/runtime/controller/sums.py), without processes: the wire form's bytes and rounding, the
rank and controller ends agreeing bit for bit round after round, int8's error feedback keeping
the consensus near the exact average, streamed pieces summed as whole ones, and cpu_async's
version bookkeeping."""

from __future__ import annotations

import pytest
import torch

from flodl.runtime.controller import sums as sums_module
from flodl.runtime.controller.sums import SnapshotSums
from flodl.runtime.sync.codec import ConsensusCodec, Packed, RankCodec, pack, unpack
from flodl.runtime.sync.compress import BLOCK
from flodl.runtime.wire import streaming
from flodl.runtime.wire.messages import Report

N_PARAMS, N_BUFFERS = 3 * BLOCK + 100, 7
N = N_PARAMS + N_BUFFERS


def _report(rank: int, window: int, snapshot, samples: int = 32) -> Report:
    return Report(rank, window, 0, ((0, samples),), 1, samples, 1.0, 0.0, 1, snapshot=snapshot)


@pytest.mark.parametrize(("kind", "per_value"), [("bf16", 2), ("fp16", 2), ("int8", 1)])
def test_packed_changes_round_trip_in_their_bytes(kind: str, per_value: int) -> None:
    """bf16/fp16: 2 bytes a value, rounding within the format's relative step; int8: 1 byte
    a value (the last block's padding not sent) and 4 per block, within half a block step."""
    torch.manual_seed(0)
    change = torch.randn(N) * 1e-2
    packed = pack(kind, change, base=3)
    blocks = -(-N // BLOCK)
    assert packed.nbytes == N * per_value + (4 * blocks if kind == "int8" else 0)
    assert packed.base == 3 and packed.n == N
    err = (unpack(packed) - change).abs()
    if kind == "int8":
        step = packed.scales.repeat_interleave(BLOCK)[:N]
        assert bool((err <= step / 2 + 1e-9).all())
    else:
        rel, tiny = (2.0**-8, 1e-30) if kind == "bf16" else (2.0**-11, 2.0**-25)  # fp16 subnormals
        assert bool((err <= change.abs() * rel + tiny).all())


def _round(ranks: list[RankCodec], weights: list[torch.Tensor], codec, sums, window: int):
    """One average: every rank snapshots, the controller sums and sends down, every rank
    takes it whole (cpu_cadence). The exact fp32 mean of what the ranks held, and the centre."""
    exact = torch.stack(weights).mean(0)
    for rank, (rc, w) in enumerate(zip(ranks, weights, strict=True)):
        packed = rc.snapshot(w)
        sums.add_whole(_report(rank, window, packed if packed is not None else w.clone()))
    mean = sums.take(window, list(range(len(ranks))))
    assert mean is not None
    payload = codec.down(window, mean, list(range(len(ranks))))
    centres = [rc.receive(window, payload) for rc in ranks]
    return exact, centres, payload


@pytest.mark.parametrize("kind", ["bf16", "fp16", "int8"])
def test_every_rank_holds_the_controllers_consensus_bit_for_bit(kind: str) -> None:
    """Round after round (ranks drifting apart between averages), each rank's centre is the
    controller's kept version exactly; the first round goes whole, the rest as changes; the
    consensus stays within rounding of the exact average of what the ranks held."""
    torch.manual_seed(1)
    codec = ConsensusCodec(kind)
    sums = SnapshotSums(gamma=1.0, codec=codec)
    sums.n_params = N_PARAMS
    ranks = [RankCodec(kind) for _ in range(3)]
    start = torch.randn(N)
    weights = [start.clone() for _ in ranks]
    for window in range(12):
        weights = [w + torch.randn(N) * 1e-3 for w in weights]
        exact, centres, payload = _round(ranks, weights, codec, sums, window)
        assert isinstance(payload, Packed) == (window > 0)
        for centre in centres:
            assert centre is not None and torch.equal(centre, codec.ref(window))
        drift = float((codec.ref(window) - exact).abs().max())
        assert drift < (2e-4 if kind == "int8" else 5e-5), (window, drift)
        weights = [c.clone() for c in centres]  # cadence: every rank loads the consensus
    assert codec.whole_windows == [0]
    assert sum(rc.sent_bytes for rc in ranks) == sums.up_bytes  # both ends count the same
    # cadence: the version the last snapshots were against and the new one are kept
    assert sorted(codec.refs) == [10, 11]


def test_int8_error_feedback_keeps_the_consensus_on_the_exact_trajectory() -> None:
    """Without error feedback int8's rounding would add up over rounds; with it (both ways),
    the consensus after many small steps stays within about one round's rounding of the
    average the same steps reach uncompressed."""
    torch.manual_seed(2)
    codec = ConsensusCodec("int8")
    sums = SnapshotSums(gamma=1.0, codec=codec)
    sums.n_params = N_PARAMS
    ranks = [RankCodec("int8") for _ in range(2)]
    exact_state = torch.randn(N)
    weights = [exact_state.clone() for _ in ranks]
    steps = [torch.randn(2, N) * 1e-4 for _ in range(40)]
    one_round = 0.0
    for window, step in enumerate(steps):
        weights = [w + s for w, s in zip(weights, step, strict=True)]
        exact_state = exact_state + step.mean(0)
        _, centres, payload = _round(ranks, weights, codec, sums, window)
        if isinstance(payload, Packed):
            one_round = max(one_round, float(payload.scales.max()))
        weights = [c.clone() for c in centres]
    gap = float((codec.ref(len(steps) - 1) - exact_state).abs().max())
    assert gap < 3 * one_round, (gap, one_round)


def test_streamed_pieces_sum_as_whole_snapshots(monkeypatch) -> None:
    """The reader's path: a Report with a packed change split as the channel streams it (its
    scales first, then its values in pieces that cross the sum's lock cells) gives the same
    mean as the same report summed whole."""
    monkeypatch.setattr(sums_module, "PIECE_BYTES", 4 * BLOCK)  # many pieces, many cells
    torch.manual_seed(3)
    ref = torch.randn(N)
    changes = [torch.randn(N) * 1e-2 for _ in range(2)]
    for kind in ("int8", "bf16"):
        results = []
        for streamed in (True, False):
            codec = ConsensusCodec(kind)
            codec.refs[5] = ref.clone()
            sums = SnapshotSums(gamma=1.0, codec=codec)
            sums.n_params = N_PARAMS
            for rank in range(2):
                packed = pack(kind, changes[rank], base=5)
                report = _report(rank, 6, packed, samples=32 * (rank + 1))
                if streamed:
                    _stream(sums, report)
                else:
                    sums.add_whole(report)
            results.append(sums.take(6, [0, 1]))
        assert results[0] is not None and torch.equal(results[0], results[1])
        assert sums.up_bytes == 2 * packed.nbytes
        w = torch.tensor([1.0, 2.0]) / 3  # by samples (gamma 1) for parameters, equal for buffers
        expect = (
            ref
            + w[0] * unpack(pack(kind, changes[0], 5))
            + w[1] * unpack(pack(kind, changes[1], 5))
        )
        assert torch.allclose(results[0][:N_PARAMS], expect[:N_PARAMS], atol=1e-6)
        equal = ref + (unpack(pack(kind, changes[0], 5)) + unpack(pack(kind, changes[1], 5))) / 2
        assert torch.allclose(results[0][N_PARAMS:], equal[N_PARAMS:], atol=1e-6)


def _stream(sums: SnapshotSums, report: Report) -> None:
    """What Channel.recv does with a claimed message: the skeleton peeked, then each claimed
    tensor's bytes handed on in PIECE_BYTES-aligned pieces, in index order."""
    skeleton, tensors = streaming.split(report)
    claimed = sums.route(streaming.peek(skeleton), streaming.describe(tensors))
    assert sorted(claimed) == list(range(len(tensors)))
    piece = sums_module.PIECE_BYTES
    for index in sorted(claimed):
        view = streaming.tensor_view(tensors[index])
        for lo in range(0, len(view), piece):
            claimed[index](lo, view[lo : lo + piece])


def test_async_versions_kept_while_a_member_may_report_against_them() -> None:
    """cpu_async: ranks report against the versions they took last, different ones; the
    controller keeps each version until no member can report against it, sums the mixed
    window right, and a report against a dropped version taints its window."""
    torch.manual_seed(4)
    codec = ConsensusCodec("bf16")
    sums = SnapshotSums(gamma=1.0, codec=codec)
    sums.n_params = N_PARAMS
    v0 = torch.randn(N)
    assert codec.down(0, v0.clone(), [0, 1]) is not None  # whole: nobody holds anything yet
    ranks = [RankCodec("bf16"), RankCodec("bf16")]
    for rc in ranks:
        rc.receive(0, v0.clone())
    v1 = codec.down(1, v0 + 1e-3, [0, 1])  # a change against version 0
    assert isinstance(v1, Packed) and v1.base == 0
    ranks[0].receive(1, v1)  # rank 0 took version 1, rank 1 is still on version 0
    a, b = torch.randn(N), torch.randn(N)
    sums.add_whole(_report(0, 2, ranks[0].snapshot(a)))
    sums.add_whole(_report(1, 2, ranks[1].snapshot(b)))
    mean = sums.take(2, [0, 1])
    assert mean is not None and float((mean - (a + b) / 2).abs().max()) < 0.05
    assert codec.held == {0: 1, 1: 0}
    codec.down(2, mean, [0, 1])
    assert sorted(codec.refs) == [0, 1, 2]  # rank 1 may still report against version 0
    ranks[1].receive(1, v1)
    sums.add_whole(_report(0, 3, ranks[0].snapshot(a)))
    sums.add_whole(_report(1, 3, ranks[1].snapshot(b)))
    codec.down(3, sums.take(3, [0, 1]), [0, 1])
    assert sorted(codec.refs) == [1, 2, 3]  # nobody reports against 0 any more
    stale = RankCodec("bf16")
    stale.receive(0, v0.clone())
    sums.add_whole(_report(0, 4, stale.snapshot(a)))
    sums.add_whole(_report(1, 4, ranks[1].snapshot(b)))
    assert sums.take(4, [0, 1]) is None  # against version 0, dropped: averages nothing


def test_a_new_membership_or_a_lost_reference_sends_the_next_average_whole() -> None:
    codec = ConsensusCodec("int8")
    state = torch.randn(N)
    codec.down(0, state.clone(), [0, 1])
    assert isinstance(codec.down(1, state + 1e-3, [0, 1]), Packed)
    codec.forget()  # a regroup
    assert not isinstance(codec.down(2, state + 2e-3, [0]), Packed)
    assert isinstance(codec.down(3, state + 3e-3, [0]), Packed)
    codec.reported(0, 3)
    codec.reported(0, None)  # a whole snapshot after a change: the rank dropped its reference
    assert not isinstance(codec.down(4, state, [0]), Packed)
    assert codec.whole_windows == [0, 2, 4]


def test_a_rank_refuses_a_change_against_a_reference_it_does_not_hold() -> None:
    rc = RankCodec("fp16")
    rc.receive(0, torch.zeros(N))
    wrong = pack("fp16", torch.ones(N), base=7)
    assert rc.receive(8, wrong) is None
    assert rc.ref is None and rc.snapshot(torch.zeros(N)) is None  # the next snapshot: whole
    with pytest.raises(ValueError, match=r"elche\.compress='zstd'"):
        RankCodec("zstd")


def test_a_modelled_link_charges_a_compressed_average_by_its_real_bytes() -> None:
    """cluster.link: the round trip an Average stands for (its snapshot up, itself down) is
    charged by the packed bytes, a half (bf16) or a quarter (int8) of the whole vector's."""
    from flodl.config.cluster import LinkConfig
    from flodl.rig import links as rig_links
    from flodl.runtime.wire.messages import Average
    from flodl.runtime.wire.rank_link import _charge_round_trip

    charged = {}
    try:
        for kind in ("none", "bf16", "int8"):
            model = rig_links.model_for(LinkConfig(profile="1gbe", latency_ms=0.0))
            rig_links.install(model)
            flat = torch.randn(N)
            _charge_round_trip(Average(1, flat if kind == "none" else pack(kind, flat, 0)))
            charged[kind] = (model.charged_bytes, model.charged_s)
    finally:
        rig_links.install(None)
    assert charged["none"][0] == 2 * 4 * N
    assert charged["bf16"][0] == 2 * 2 * N
    assert charged["int8"][0] == 2 * (N + 4 * (-(-N // BLOCK)))
    assert charged["int8"][1] < charged["bf16"][1] < charged["none"][1]
