"""Training features through the Python API: per-step LR, LR announcement, precision,
accumulation, compile. In-process runs (one rank, no process) are ``light``; the 2-rank rig
runs are ``slow``."""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, EpochMetrics, LoggerConfig, Trainer
from flodl.recipes.steps import classification_step
from flodl.step.schedules import RunLength, advance_to

from .helpers import data, model_factory

N_TRAIN = 512


def sgd(params: Any, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=total_steps)


def local(tmp_path, name: str, epochs: int = 3, batch: int = 32, **cluster: Any):
    """A builder for a one-rank, in-process run (no rank process)."""
    return (
        Trainer.builder(model_factory, sgd, classification_step)
        .dataset(partial(data, "train", N_TRAIN))
        .batch_size(batch)
        .num_epochs(epochs)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=1, warmup_steps=2, **cluster))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / name)
    )


@pytest.mark.light
def test_one_cycle_per_step_follows_the_run_clock_and_is_announced(tmp_path, caplog):
    """The measured bug: OneCycleLR under a per-epoch scheduler never left warm-up. Per step,
    each epoch ends on the schedule's value at that epoch's global progress."""
    seen: list[EpochMetrics] = []
    caplog.set_level(logging.INFO, logger="flodl")
    handle = (
        local(tmp_path, "onecycle")
        .scheduler(one_cycle, interval="step")
        .metrics_fn(seen.append)
        .run()
    )
    handle.join(timeout=120)
    run = RunLength(3 * N_TRAIN, 32)
    reference = one_cycle(sgd([torch.nn.Parameter(torch.zeros(1))]), run.total_steps)
    expected = []
    for epoch in range(3):
        advance_to(reference, run.target_step((epoch + 1) * N_TRAIN))
        expected.append(reference.optimizer.param_groups[0]["lr"])
    assert [m.lr for m in seen] == pytest.approx(expected)
    assert expected[0] > 0.1  # a third of the way in: near max_lr, far past warm-up
    assert expected[-1] < expected[0] / 100  # annealed: the end of the cycle
    assert "lr 0.05 \u00d7 1.0 (lr_scale_ratio 1.0, 1 rank) = 0.05" in caplog.text
    summary = json.loads((handle.job_dir / "summary.json").read_text())
    assert summary["lr_scaling"] == {
        "base_lr": 0.05,
        "factor": 1.0,
        "lr_scale_ratio": 1.0,
        "world_size": 1,
        "lr": 0.05,
    }


@pytest.mark.light
def test_per_step_scheduler_under_epoch_interval_is_warned_at_launch(tmp_path, caplog):
    seen: list[EpochMetrics] = []
    handle = local(tmp_path, "warned", epochs=2).scheduler(one_cycle).metrics_fn(seen.append).run()
    handle.join(timeout=120)
    warned = [r for r in caplog.records if "scheduler.interval=epoch" in r.getMessage()]
    assert len(warned) == 1 and "OneCycleLR" in warned[0].getMessage()
    # Stepped once per epoch, as asked; its total_steps is then the run's length in epochs.
    reference = one_cycle(sgd([torch.nn.Parameter(torch.zeros(1))]), 2)
    assert seen[0].lr == pytest.approx(reference.optimizer.param_groups[0]["lr"])


def _trained(builder) -> tuple[Any, Any]:
    handle = builder.run()
    state = handle.join(timeout=180)
    return handle, state


@pytest.mark.light
def test_bf16_mixed_on_cpu_is_within_a_point_of_fp32_and_keeps_fp32_weights(tmp_path):
    from flodl.recipes.steps import accuracy

    results = {}
    for precision in ("32", "bf16-mixed"):
        builder = (
            local(tmp_path, f"p{precision}", epochs=3)
            .eval_dataset(partial(data, "test"))
            .eval_fn(accuracy)
            .precision(precision)
        )
        handle, state = _trained(builder)
        results[precision] = (handle.result.summary.eval_value, state)
    fp32, bf16 = results["32"][0], results["bf16-mixed"][0]
    assert fp32 is not None and bf16 is not None and fp32 > 0.5  # it learned
    assert abs(fp32 - bf16) <= 0.01
    assert {t.dtype for t in results["bf16-mixed"][1].params.values()} == {torch.float32}
    # Autocast really ran: the weights differ from the fp32 run's.
    a, b = results["32"][1].params, results["bf16-mixed"][1].params
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.light
def test_accumulating_16_x_4_matches_batch_64_on_one_rank(tmp_path):
    """SGD, no BatchNorm: four micro-batches of 16 average to the gradient of their 64."""
    _, big = _trained(local(tmp_path, "b64", epochs=2, batch=64))
    handle, acc = _trained(local(tmp_path, "b16x4", epochs=2, batch=16).accumulate_grad_batches(4))
    for name, tensor in big.params.items():
        torch.testing.assert_close(acc.params[name], tensor, rtol=1e-4, atol=1e-6)
    per_rank = handle.result.epochs[-1].per_rank[0]
    assert per_rank["batches"] == N_TRAIN / 16  # ElChe and dispatch count micro-batches
    assert per_rank["samples"] == N_TRAIN


@pytest.mark.light
def test_16_mixed_on_a_cpu_rank_is_refused_before_anything_starts(tmp_path):
    from flodl.config import ConfigError

    with pytest.raises(ConfigError, match=r"trainer\.precision=16-mixed: rank\(s\) \[0, 1\]"):
        local(tmp_path, "fp16").precision("16-mixed").cluster(
            ClusterConfig(kind="cpu_rig", ranks=2)
        ).run()
    assert not (tmp_path / "fp16").exists()


def _compile_works() -> str | None:
    import shutil
    import sys

    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        return "torch.compile (inductor) needs a C compiler on CPU; none found"
    if sys.version_info >= (3, 14) and torch.__version__ < "2.9":
        return f"torch.compile {torch.__version__} does not support Python {sys.version_info[:2]}"
    return None


@pytest.mark.light
def test_compile_trains_and_the_state_is_the_original_modules(tmp_path):
    reason = _compile_works()
    if reason is not None:
        pytest.skip(reason)
    handle, state = _trained(local(tmp_path, "compiled", epochs=2).compile())
    losses = [m.avg_loss for m in handle.result.epochs]
    assert losses[-1] < losses[0]
    assert set(state.params) == set(model_factory(torch.device("cpu")).state_dict())
    state.load_into(model_factory(torch.device("cpu")))  # strict: no _orig_mod. prefixes


@pytest.mark.slow
def test_per_rank_batch_sizes_share_samples_and_the_lr_clock_on_a_2_rank_rig(tmp_path):
    """[64, 16] with equal batch counts, accumulating 2: 0.8 / 0.2 of the samples, coverage
    exact, and a per-step warm-up+cosine ends each epoch on the value its global progress
    implies."""
    from flodl.step.schedules import warmup_cosine

    seen: list[EpochMetrics] = []
    n = 1280
    handle = (
        Trainer.builder(model_factory, sgd, classification_step)
        .dataset(partial(data, "train", n))
        .batch_size(32)
        .num_epochs(2)
        .accumulate_grad_batches(2)
        .scheduler(partial(warmup_cosine, warmup_fraction=0.2, floor=0.1), interval="step")
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, batch_sizes=[64, 16], warmup_steps=2))
        # Equal batch counts by construction (timed counts would follow load noise on 2 cores).
        .elche(ElCheConfig(partition_ratios=[1.0, 1.0]))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .metrics_fn(seen.append)
        .output_dir(tmp_path / "sizes")
        .run()
    )
    handle.join(timeout=240)
    summary = handle.result.summary
    assert summary.per_rank_sample_share == pytest.approx([0.8, 0.2], abs=0.01)
    assert summary.per_rank_batch_share == pytest.approx([0.5, 0.5], abs=0.02)
    assert summary.coverage_exact and summary.samples_seen == 2 * n
    run = RunLength(2 * n, (64 + 16) * 2)  # a global step: both ranks' batches, 2 micro each
    reference = warmup_cosine(
        sgd([torch.nn.Parameter(torch.zeros(1))], lr=0.1), run.total_steps, 0.2, 0.1
    )
    expected = []
    for epoch in range(2):  # lr 0.05 x 2.0 (2 ranks, lr_scale_ratio 1.0) = 0.1
        advance_to(reference, run.target_step((epoch + 1) * n))
        expected.append(reference.optimizer.param_groups[0]["lr"])
    assert [m.lr for m in seen] == pytest.approx(expected)
    assert expected[-1] == pytest.approx(0.01)  # the floor, at the run's end
    summary_json = json.loads((handle.job_dir / "summary.json").read_text())
    assert summary_json["lr_scaling"]["lr"] == pytest.approx(0.1)


@pytest.mark.light
def test_cooperative_backward_accumulates_like_the_managed_tier(tmp_path):
    """worker.backward(loss) in your own loop: 16 x 4 lands on the managed batch-64 weights."""
    _, big = _trained(local(tmp_path, "b64", epochs=1, batch=64))
    worker = local(tmp_path, "coop", epochs=1, batch=16).accumulate_grad_batches(4).into_worker()
    stepped = 0
    for _ in worker.epochs():
        for batch in worker.batches():
            with worker.autocast():
                loss = classification_step(worker.model, batch)
            stepped += worker.backward(loss)
            worker.step(loss)
    state = worker.finish()
    assert stepped == N_TRAIN // 64  # every group of 4 was complete: stepped inside the loop
    for name, tensor in big.params.items():
        torch.testing.assert_close(state.params[name], tensor, rtol=1e-4, atol=1e-6)


def fixed_warmup_cosine(optimizer: torch.optim.Optimizer) -> Any:
    from flodl.step.schedules import warmup_cosine

    return warmup_cosine(optimizer, total_steps=32, warmup_fraction=0.25, floor=0.1)


@pytest.mark.light
def test_resume_lands_on_the_same_lr_clock_and_weights(tmp_path):
    """1 epoch, save, resume to 2 == 2 straight: the clock is derived from epoch and coverage,
    the scheduler's state rides in the bundle."""
    from flodl import TrainerConfig

    def run(name: str, epochs: int, **cfg: Any):
        seen: list[EpochMetrics] = []
        builder = local(tmp_path, name, epochs=epochs).config(TrainerConfig(**cfg))
        builder = builder.scheduler(fixed_warmup_cosine, interval="step").metrics_fn(seen.append)
        _, state = _trained(builder)
        return seen, state

    straight, s_state = run("straight", 2)
    stem = str(tmp_path / "ckpt" / "run")
    first, _ = run("first", 1, save_path=stem)
    resumed, r_state = run("resumed", 2, resume_from=stem)
    assert first[0].lr == pytest.approx(straight[0].lr)
    assert [m.epoch for m in resumed] == [2]  # epochs count from 1: the second
    assert resumed[0].lr == pytest.approx(straight[1].lr)  # step 32 of 32: the floor
    assert straight[1].lr == pytest.approx(0.005)
    for name, tensor in s_state.params.items():
        torch.testing.assert_close(r_state.params[name], tensor)


_calls = {"n": 0}


def _one_slow_step(model: Any, batch: Any) -> torch.Tensor:
    """The 6th step outlasts the heartbeat timeout (a first compiled step, a long eval)."""
    import time

    _calls["n"] += 1
    if _calls["n"] == 6:
        time.sleep(2.5)
    return classification_step(model, batch)


@pytest.mark.light
def test_an_in_process_rig_run_gives_the_caller_its_torch_threads_back(tmp_path):
    """The rig pins a rank to ``cluster.threads_per_rank`` threads; in-process that is the
    caller's own process (a notebook, this test process). torch's count is process-wide and
    taken up by each thread at its first parallel work, so a thread started after the run (a
    later run's launcher or rank thread) would get the rank's 1 thread."""
    import threading

    def fresh_thread_count() -> int:
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return seen[0]

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        handle = (
            Trainer.builder(model_factory, sgd, classification_step)
            .dataset(partial(data, "train", 128))
            .batch_size(32)
            .num_epochs(1)
            .cluster(ClusterConfig(kind="cpu_rig", ranks=1, warmup_steps=1, threads_per_rank=1))
            .logger(LoggerConfig(progress="off", tensorboard=False))
            .output_dir(tmp_path)
            .run()
        )
        handle.join(timeout=60)
        assert handle.result.coverage_exact
        assert fresh_thread_count() == 2
    finally:
        torch.set_num_threads(before)


def test_an_in_process_step_longer_than_the_heartbeat_timeout_drops_no_rank(tmp_path):
    """Measured: torch.compile's first step on a loaded machine outlasted the 30 s heartbeat
    timeout and the only rank of an in-process run was dropped as stale (``every rank was lost;
    last: heartbeat went stale``). The rank shares the launcher's process; it beats like one."""
    _calls["n"] = 0
    handle = (
        Trainer.builder(model_factory, sgd, _one_slow_step)
        .dataset(partial(data, "train", 256))
        .batch_size(32)
        .num_epochs(1)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=1, warmup_steps=2, heartbeat_timeout_s=1.0))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / "slow_step")
        .run()
    )
    handle.join(timeout=60)
    assert _calls["n"] >= 6
    assert handle.result.coverage_exact and len(handle.result.epochs) == 1
