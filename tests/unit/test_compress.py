"""Compressed averaging (flodl/runtime/sync/compress.py): int8 blocks and error feedback on fake
tensors, and real two-process gloo averages in bf16, fp16 and int8: the bytes on the wire, the
agreement with the exact fp32 average, and bit-identical weights on every rank."""

from __future__ import annotations

import sys

import pytest
import torch

from flodl.config import ElCheConfig
from flodl.runtime.sync.compress import BLOCK, Compressor, dequantize, quantize
from tests.two_ranks import run_two_ranks, write_result


def test_int8_blocks_round_trip_within_half_a_step() -> None:
    x = torch.randn(3 * BLOCK + 17) * torch.linspace(0.01, 10, 3 * BLOCK + 17)
    q, scales = quantize(x)
    assert q.dtype == torch.int8 and scales.numel() == 4
    err = (dequantize(q, scales, x.numel()) - x).abs()
    step = scales.repeat_interleave(BLOCK)[: x.numel()]
    assert bool((err <= step / 2 + 1e-7).all())


def test_error_feedback_loses_nothing_for_good() -> None:
    """Summed over many rounds, what int8 sent equals what there was to send, to within one
    round's rounding (the residual), not 50 rounds' worth."""
    torch.manual_seed(0)
    c = Compressor("int8")
    sent, true = torch.zeros(1000), torch.zeros(1000)
    for _ in range(50):
        change = torch.randn(1000) * 1e-3
        true += change
        x = change + (c.residual if c.residual is not None else 0)
        q, s = quantize(x)
        c.residual = x - dequantize(q, s, 1000)
        sent += dequantize(q, s, 1000)
    assert float((sent - true).abs().max()) <= float(c.residual.abs().max()) + 1e-7


def test_compress_applies_to_averaging_modes_only() -> None:
    """Every mode that averages weights compresses (the collective and the controller's);
    nccl_sync (gradients) and solo (nothing) refuse it, naming the key and the way out."""
    for mode in ("nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"):
        assert ElCheConfig(mode=mode, compress="int8").compress == "int8"
    with pytest.raises(ValueError, match=r"elche\.compress=bf16: mode=nccl_sync reduces gradients"):
        ElCheConfig(mode="nccl_sync", compress="bf16")
    with pytest.raises(ValueError, match=r"mode=solo averages nothing.*elche\.compress=none"):
        ElCheConfig(mode="solo", compress="fp16")
    assert ElCheConfig(mode="solo").compress == "none"


N = 100_000


def _ranks(rank: int, rendezvous: str, out: str) -> None:
    import torch.distributed as dist
    from torch import nn

    from flodl.runtime.sync.averaging import FlatState, collective_average

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    weight = [0.7, 0.3][rank]
    result = {}
    for kind in ("bf16", "fp16", "int8"):
        torch.manual_seed(0)
        model = nn.Linear(N // 10, 10, bias=False)
        state = FlatState(model, share_storage=True)
        comp = Compressor(kind)
        collective_average(state, 0.5, 0.5, compressor=comp)  # uncompressed: sets the ref
        assert comp.ref is not None and comp.sent_bytes == 0
        with torch.no_grad():  # each rank trains a little, differently
            torch.manual_seed(rank + 1)
            model.weight.add_(torch.randn_like(model.weight) * 1e-2)
        mine = state.flatten()
        ref_before = comp.ref.clone()
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)  # only to compute the exact average here
        exact = 0.7 * both[0] + 0.3 * both[1]
        collective_average(state, weight, weight, compressor=comp)
        got = state.flatten()
        digest = torch.tensor([float(got.double().sum()), float(got.double().square().sum())])
        rank0 = digest.clone()
        dist.broadcast(rank0, src=0)
        result[kind] = {
            "sent_bytes": comp.sent_bytes,
            "max_err": float((got - exact).abs().max()),
            "max_change": float((mine - ref_before).abs().max()),
            "same_on_every_rank": bool(torch.equal(rank0, digest)),
            "ref_is_weights": bool(torch.equal(comp.ref, got)),
        }
    write_result(rank, out, result)
    dist.destroy_process_group()


@pytest.mark.slow
def test_compressed_averages_on_two_real_ranks() -> None:
    result = run_two_ranks("tests.unit.test_compress")
    fp32 = 4 * N
    assert result["bf16"]["sent_bytes"] == result["fp16"]["sent_bytes"] == fp32 // 2
    blocks = -(-N // BLOCK)
    # a quarter (the last block padded), plus a float32 scale per block
    assert result["int8"]["sent_bytes"] == blocks * BLOCK + 4 * blocks
    assert result["int8"]["sent_bytes"] < 0.26 * fp32
    for kind, r in result.items():
        assert r["same_on_every_rank"] and r["ref_is_weights"], kind
        # Only the change is rounded: the error is a rounding of a ~1e-2 change, not of the weights.
        bound = {"bf16": 2**-8, "fp16": 2**-11, "int8": 1 / 127}[kind]
        assert r["max_err"] <= 2 * bound * r["max_change"] + 1e-7, (kind, r)


if __name__ == "__main__":  # one rank of the two-process test above
    _ranks(int(sys.argv[3]), sys.argv[1], sys.argv[2])
