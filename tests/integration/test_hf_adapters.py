"""Adapter-only averaging across a real process boundary: two gloo ranks holding a LoRA model
on a frozen bf16 base average, broadcast and all-reduce gradients; every byte handed to a
collective, and every byte the link model charges, is an adapter's (skipped without flodl[hf])."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from tests.two_ranks import run_two_ranks, write_result

pytestmark = pytest.mark.slow


def _model(seed: int):
    from flodl.hf.models import auto_model
    from tests import hf_tiny

    torch.manual_seed(0)  # the same base on both ranks
    model = auto_model(config=hf_tiny.gpt2_config(), dtype="bfloat16", peft=hf_tiny.LORA)
    torch.manual_seed(seed)  # adapters apart: lora_B starts at zero, so move both
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.1)
    return model


def _sent(log: list[int]):
    """Wrap dist.all_reduce / broadcast so every tensor handed to them is counted."""
    real = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}

    def counting(name):
        def call(tensor, *args, **kwargs):
            log.append(tensor.numel() * tensor.element_size())
            return real[name](tensor, *args, **kwargs)

        return call

    for name in real:
        setattr(dist, name, counting(name))


def _rank(rank: int, rdv: str, out: str) -> None:
    from flodl.config.cluster import LinkConfig
    from flodl.rig import links
    from flodl.runtime.sync.averaging import FlatState, broadcast_from, collective_average
    from flodl.runtime.sync.gradsync import GradSync
    from flodl.runtime.sync.trainable import base_fingerprint
    from tests import hf_tiny

    dist.init_process_group("gloo", init_method=rdv, rank=rank, world_size=2)
    model = _model(seed=rank + 1)
    adapter_bytes = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)
    base_before = base_fingerprint(model)
    sent: list[int] = []
    _sent(sent)
    link = links.model_for(LinkConfig.model_validate({"profile": "1gbe", "latency_ms": 0.0}))
    links.install(link)
    state = FlatState(model, share_storage=True)
    result: dict = {"adapter_bytes": adapter_bytes}
    result["full_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())

    collective_average(state, 0.25 if rank == 0 else 0.75, 0.5)  # nccl_cadence's average
    result["average"] = {"sent": sum(sent), "charged": link.charged_bytes}
    mine = state.flatten()
    gathered = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(gathered, mine)
    result["agree"] = bool(torch.equal(gathered[0], gathered[1]))

    sent.clear()
    link.charged_bytes = 0
    broadcast_from(state, src=0)  # a start or a rejoin
    result["broadcast"] = {"sent": sum(sent), "charged": link.charged_bytes}

    sent.clear()
    link.charged_bytes = 0
    sync = GradSync(model)  # nccl_sync's bucketed gradient all-reduce
    sync.armed = True
    ids = torch.randint(
        0, hf_tiny.VOCAB, (2, hf_tiny.BLOCK), generator=torch.Generator().manual_seed(rank)
    )
    model(input_ids=ids, labels=ids).loss.backward()
    sync.finish()
    result["gradients"] = {"sent": sum(sent), "charged": link.charged_bytes}
    result["base_unchanged"] = base_fingerprint(model) == base_before
    write_result(rank, out, result)
    dist.destroy_process_group()


def test_only_adapter_bytes_cross_the_wire() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    result = run_two_ranks("tests.integration.test_hf_adapters")
    adapter = result["adapter_bytes"]
    assert adapter == 4 * 2 * (2 * 32 + 3 * 32 * 2)  # rank-2 LoRA on 2 layers' c_attn, fp32
    for what in ("average", "broadcast", "gradients"):
        assert result[what] == {"sent": adapter, "charged": adapter}, what
    assert result["agree"] and result["base_unchanged"]
    assert adapter < 0.05 * result["full_bytes"]


if __name__ == "__main__":  # one rank of the two-process test above
    _rank(int(sys.argv[3]), sys.argv[1], sys.argv[2])
