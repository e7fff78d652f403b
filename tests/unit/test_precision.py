"""The step runner: accumulation arithmetic, the GradScaler's skip and state, bundle round trip."""

from __future__ import annotations

import pytest
import torch

from flodl.checkpoint.shards import load_shard
from flodl.runtime.controller.snapshots import Checkpointer, ResumePoint
from flodl.runtime.wire.messages import RankState
from flodl.step.precision import StepRunner

CPU = torch.device("cpu")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1, bias=False)


def _cpu_fp16() -> bool:
    try:
        torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            torch.nn.Linear(2, 2)(torch.randn(1, 2))
    except Exception:
        return False
    return True


def test_accumulated_step_uses_the_mean_gradient_of_the_micro_batches():
    x = torch.randn(8, 4)
    whole, parts = _model(), _model()
    opt_whole = torch.optim.SGD(whole.parameters(), lr=0.1)
    opt_parts = torch.optim.SGD(parts.parameters(), lr=0.1)
    whole(x).pow(2).mean().backward()
    opt_whole.step()
    runner = StepRunner("32", CPU, accumulate=4)
    for chunk in x.split(2):
        assert not runner.due
        runner.backward(parts(chunk).pow(2).mean())
    assert runner.due and runner.step(parts, opt_parts)
    torch.testing.assert_close(parts.weight, whole.weight)
    assert parts.weight.grad is None and runner.pending == 0  # nothing left pending


def test_a_short_last_group_is_averaged_over_what_it_has():
    x = torch.randn(4, 4)
    whole, parts = _model(), _model()
    opt_whole = torch.optim.SGD(whole.parameters(), lr=0.1)
    opt_parts = torch.optim.SGD(parts.parameters(), lr=0.1)
    whole(x).pow(2).mean().backward()
    opt_whole.step()
    runner = StepRunner("32", CPU, accumulate=8)
    for chunk in x.split(2):  # 2 of 8: the window ended early
        runner.backward(parts(chunk).pow(2).mean())
    runner.step(parts, opt_parts)
    torch.testing.assert_close(parts.weight, whole.weight)


@pytest.mark.skipif(not _cpu_fp16(), reason="this torch has no fp16 autocast/GradScaler on CPU")
def test_scaler_skips_a_non_finite_step_and_its_state_survives_a_bundle(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = StepRunner("16-mixed", CPU)
    before = model.weight.detach().clone()
    runner.backward(model(torch.full((1, 4), float("inf"))).sum())
    assert runner.step(model, opt) is False  # inf gradients: skipped, scale lowered
    assert torch.equal(model.weight, before)
    with runner.autocast():
        loss = model(0.01 * torch.randn(2, 4)).float().mean()  # no fp16 overflow at 2**15
    runner.backward(loss)
    assert runner.step(model, opt) is True
    assert not torch.equal(model.weight, before)
    state = runner.state_dict()
    assert state is not None and state["scale"] == 2.0**15  # 2**16 halved once

    saver = Checkpointer(str(tmp_path / "b"), None, "hash", 1, signature="sig")
    params = {"weight": model.weight.detach().clone()}
    save = saver.open(-1, "final", 1, [0], writer=0)
    mine = {"optimizer": opt.state_dict(), "scheduler": None, "rng": torch.get_rng_state()}
    shards = {"rank0": {**mine, "scaler": state}, "model": {"params": params, "buffers": {}}}
    done = saver.collect(RankState(0, -1, save.tag, shards))
    assert done is not None
    saver.commit(
        done,
        extra={},
        epoch=1,
        global_step=2,
        sync_round=0,
        elche_state=None,
        coverage={"epoch": 1, "n_samples": 4, "uncovered": []},
    )
    restored = StepRunner("16-mixed", CPU)
    restore = ResumePoint.load(str(tmp_path / "b")).restore_for(0)
    restored.load_state_dict(load_shard(restore.state)["scaler"])
    assert restored.scaler is not None and restored.scaler.get_scale() == 2.0**15


def _nan_gradients(model: torch.nn.Module) -> torch.Tensor:
    """A finite loss whose gradient is NaN (as one bad batch through a sqrt at 0 gives)."""
    out = model(torch.ones(2, 4))
    out.register_hook(lambda g: torch.full_like(g, float("nan")))
    return out.sum()


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_fp32_skips_a_step_whose_gradients_are_not_finite(max_grad_norm):
    """Issue 41: fp32 never checked gradients; one NaN step wrote NaN into the weights."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    runner = StepRunner("32", CPU, max_grad_norm=max_grad_norm)
    before = model.weight.detach().clone()
    loss = _nan_gradients(model)
    assert torch.isfinite(loss)
    runner.backward(loss)
    assert runner.step(model, opt) is False
    assert torch.equal(model.weight, before) and model.weight.grad is None
    assert opt.state_dict()["state"] == {}  # Adam's moments never saw the NaN
    runner.backward(model(torch.ones(2, 4)).sum())
    assert runner.step(model, opt) is True
    assert torch.isfinite(model.weight).all() and not torch.equal(model.weight, before)


def test_clipping_still_clips_finite_gradients():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    runner = StepRunner("32", CPU, max_grad_norm=0.5)
    before = model.weight.detach().clone()
    runner.backward(model(torch.full((1, 4), 100.0)).sum())
    assert runner.step(model, opt) is True
    step = torch.linalg.vector_norm(model.weight.detach() - before)
    assert step == pytest.approx(0.5, rel=1e-4)


def test_bf16_skips_a_step_whose_gradients_are_not_finite():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = StepRunner("bf16-mixed", CPU)
    before = model.weight.detach().clone()
    with runner.autocast():
        loss = _nan_gradients(model)
    runner.backward(loss.float())
    assert runner.step(model, opt) is False
    assert torch.equal(model.weight, before)


def test_flat_state_tells_non_finite_weights():
    from flodl.runtime.sync.averaging import FlatState

    for share in (True, False):
        model = _model()
        state = FlatState(model, share_storage=share)
        assert state.finite()
        with torch.no_grad():
            model.weight[0, 2] = float("inf")
        assert not state.finite()


def _bundle_with(tmp_path, weight: torch.Tensor) -> str:
    saver = Checkpointer(str(tmp_path / "b"), None, "hash", 1, signature="sig")
    save = saver.open(-1, "final", 1, [0], writer=0)
    mine = {"optimizer": {}, "scheduler": None, "rng": torch.get_rng_state()}
    shards = {"rank0": mine, "model": {"params": {"weight": weight}, "buffers": {}}}
    done = saver.collect(RankState(0, -1, save.tag, shards))
    assert done is not None
    saver.commit(
        done,
        extra={},
        epoch=1,
        global_step=2,
        sync_round=0,
        elche_state=None,
        coverage={"epoch": 1, "n_samples": 4, "uncovered": []},
    )
    return str(tmp_path / "b")


def test_resuming_from_a_non_finite_bundle_is_refused(tmp_path):
    """Issue 41: a bundle of NaN weights was accepted; now refused before any rank starts."""
    from flodl.checkpoint.bundle import CheckpointError

    good = _bundle_with(tmp_path / "good", torch.ones(1, 4))
    assert ResumePoint.load(good).meta.epoch == 1
    bad = _bundle_with(tmp_path / "bad", torch.tensor([[1.0, float("nan"), 0.0, 0.0]]))
    with pytest.raises(CheckpointError, match=r"weights are NaN/inf \(weight, epoch 1\); refused"):
        ResumePoint.load(bad)


def test_the_launcher_refuses_a_non_finite_resume_bundle_with_exit_2(tmp_path):
    """The preflight every launch runs (before any rank): a ConfigError naming the key."""
    from flodl.config import ConfigError, TrainerConfig
    from flodl.preflight import check_run

    bad = _bundle_with(tmp_path, torch.tensor([[float("inf"), 0.0, 0.0, 0.0]]))
    with pytest.raises(ConfigError) as info:
        check_run(TrainerConfig(resume_from=bad, num_epochs=3), world_size=2)
    assert str(info.value).startswith(f"trainer.resume_from={bad}: the bundle's weights are")
    assert info.value.exit_code == 2
