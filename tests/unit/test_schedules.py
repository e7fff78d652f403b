"""Per-step LR on the global progress clock: presets, clock, planning stamps (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from flodl.runtime.wire.messages import Plan
from flodl.step import schedules

from .test_controller import drive, make


def _opt(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _lr(scheduler) -> float:
    return scheduler.optimizer.param_groups[0]["lr"]


def test_warmup_cosine_shape_matches_hand_computation():
    sched = schedules.warmup_cosine(_opt(0.1), total_steps=100, warmup_fraction=0.1, floor=0.2)
    assert _lr(sched) == pytest.approx(0.1 / 11)  # step 0 of 10 warm-up steps
    schedules.advance_to(sched, 10)
    assert _lr(sched) == pytest.approx(0.1)  # the peak, where the cosine starts
    schedules.advance_to(sched, 55)  # half-way through the cosine
    assert _lr(sched) == pytest.approx(0.1 * (0.2 + 0.8 * 0.5))
    schedules.advance_to(sched, 100)
    assert _lr(sched) == pytest.approx(0.02)  # the floor
    assert schedules.is_per_step(sched)
    assert not schedules.is_per_step(torch.optim.lr_scheduler.StepLR(_opt(), 1))


def test_warmup_cosine_refuses_bad_fractions():
    with pytest.raises(ValueError, match=r"warmup_fraction=1\.5"):
        schedules.warmup_cosine(_opt(), 10, warmup_fraction=1.5)
    with pytest.raises(ValueError, match="floor=2"):
        schedules.warmup_cosine(_opt(), 10, floor=2)


def test_run_length_clock_reaches_total_steps_exactly():
    run = schedules.RunLength(samples=3 * 1000, global_batch=64)
    assert run.total_steps == math.ceil(3000 / 64) == 47
    assert run.target_step(0) == 0
    assert run.target_step(1500) == 23  # floor(47 / 2)
    assert run.target_step(3000) == 47
    assert run.target_step(10**9) == 47  # clamped


def test_lr_agrees_across_ranks_with_unequal_shares_at_equal_progress():
    """Rank 0 trains 3x the samples of rank 1 per window; both read the same LR whenever the
    cohort is at the same global progress (window ends, and equal fractions of their shares)."""
    run = schedules.RunLength(samples=1200, global_batch=40)  # 30 global steps
    fast = schedules.warmup_cosine(_opt(), run.total_steps, 0.2, 0.1)
    slow = schedules.warmup_cosine(_opt(), run.total_steps, 0.2, 0.1)
    before, traces = 0, ([], [])
    for _ in range(5):  # windows of 240 samples: 180 to rank 0 (9 batches of 20), 60 to rank 1
        for i in range(1, 10):
            done = schedules.global_samples(before, 240, 20 * i, 180)
            schedules.advance_to(fast, run.target_step(done))
            if i % 3 == 0:  # rank 1 has done the same fraction of its share
                slow_done = schedules.global_samples(before, 240, 20 * (i // 3), 60)
                assert slow_done == done
                schedules.advance_to(slow, run.target_step(slow_done))
                traces[0].append(_lr(fast))
                traces[1].append(_lr(slow))
        before += 240
    assert traces[0] == traces[1]
    assert fast.last_epoch == slow.last_epoch == 30  # the end of the run: the floor
    assert _lr(fast) == pytest.approx(0.01)
    assert max(traces[0]) == pytest.approx(0.1, rel=0.05)  # warm-up ended at the peak


def test_one_cycle_on_the_clock_reaches_max_lr_and_never_oversteps():
    opt = _opt(0.01)
    kwargs = schedules.fill_total_steps(
        torch.optim.lr_scheduler.OneCycleLR, {"max_lr": 0.5, "total_steps": "auto"}, 40
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, **kwargs)
    peak = 0.0
    for step in range(1, 200):  # asks for far more steps than the schedule has
        schedules.advance_to(sched, step)
        peak = max(peak, _lr(sched))
    assert peak == pytest.approx(0.5)
    assert sched.last_epoch == 40


def test_fill_total_steps_only_where_the_target_takes_it():
    one_cycle = torch.optim.lr_scheduler.OneCycleLR
    assert schedules.fill_total_steps(one_cycle, {"max_lr": 1.0}, 7)["total_steps"] == 7
    given = {"max_lr": 1.0, "epochs": 2, "steps_per_epoch": 3}
    assert "total_steps" not in schedules.fill_total_steps(one_cycle, given, 7)
    assert schedules.fill_total_steps(one_cycle, {"total_steps": 5}, 7)["total_steps"] == 5
    step_lr = torch.optim.lr_scheduler.StepLR
    assert schedules.fill_total_steps(step_lr, {"step_size": 2}, 7) == {"step_size": 2}
    with pytest.raises(ValueError, match="total_steps=auto"):
        schedules.fill_total_steps(one_cycle, {"total_steps": "auto"}, None)


def test_build_passes_total_steps_to_factories_that_take_it():
    seen = []

    def with_total(optimizer, total_steps):
        seen.append(total_steps)
        return torch.optim.lr_scheduler.StepLR(optimizer, 1)

    schedules.build(with_total, _opt(), 12)
    schedules.build(lambda o: torch.optim.lr_scheduler.StepLR(o, 1), _opt(), 12)
    assert seen == [12]


def test_plans_stamp_each_window_with_the_global_progress_before_it():
    ctl, links = make(world=2, epochs=2, n=1000, bs=10)
    drive(ctl, links)
    windows: dict[int, tuple[int, int]] = {}
    own: dict[int, int] = {}
    for link in links:
        for msg in link.sent:
            if isinstance(msg, Plan):
                for w in msg.windows:
                    assert windows.setdefault(w.index, (w.progress, w.window_samples)) == (
                        w.progress,
                        w.window_samples,
                    )  # every rank of a window reads the same clock
                    own[w.index] = own.get(w.index, 0) + sum(s for _, s in w.chunks)
    position = 0
    for index in sorted(windows):
        progress, size = windows[index]
        assert progress == position
        assert size == own[index]  # the window's samples over all ranks
        position += size
    assert position == 2 * 1000


def test_lr_scaling_announcement_names_every_number():
    from flodl.preflight import format_lr_scaling, lr_scaling

    record = lr_scaling(0.05, 1.0, 2)
    assert record["factor"] == 2.0 and record["lr"] == pytest.approx(0.1)
    assert format_lr_scaling(record) == "lr 0.05 \u00d7 2.0 (lr_scale_ratio 1.0, 2 ranks) = 0.1"
    assert (
        format_lr_scaling(lr_scaling(None, 0.5, 3)) == "lr \u00d7 2.0 (lr_scale_ratio 0.5, 3 ranks)"
    )


def test_per_rank_batch_sizes_plan_samples_and_weight_the_average_by_them():
    """Ranks of batch 64 and 16 at equal speed: equal batch counts, sample shares 0.8 / 0.2, and
    the controller's average (cpu_cadence) is 0.8 a + 0.2 b, checked by hand."""
    from flodl.config import ElCheConfig, TrainerConfig
    from flodl.runtime.controller.controller import Controller
    from flodl.runtime.wire.messages import Average, Ready, Report

    from .test_controller import FakeLink

    cfg = TrainerConfig(num_epochs=1, batch_size=32, elche=ElCheConfig(mode="cpu_cadence"))
    ctl = Controller(cfg, 2, [1.0, 1.0], has_eval=False)
    links = [FakeLink(), FakeLink()]
    for rank, link in enumerate(links):
        ctl.attach(rank, link)
    for rank, size in enumerate((64, 16)):
        ctl.handle(rank, Ready(rank, "sig", 2, 1.0, "cpu", 800, batch_size=size))
    assert ctl.planner.batch_sizes == [64, 16]
    first = [msg.windows[0] for msg in (link.sent[-1] for link in links)]
    samples = [sum(s for _, s in w.chunks) for w in first]
    assert samples == [640, 160]  # anchor 10 batches each, of their own size
    assert [w.weight for w in first] == pytest.approx([0.8, 0.2])
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    for rank, (w, flat) in enumerate(zip(first, (a, b), strict=True)):
        ctl.handle(
            rank,
            # a clone: the controller consumes snapshots (averages into the first, in place)
            Report(
                rank, w.index, 0, w.chunks, 10, samples[rank], 10.0, 1.0, 10, snapshot=flat.clone()
            ),
        )
    average = next(m for m in links[0].sent if isinstance(m, Average))
    torch.testing.assert_close(average.flat, 0.8 * a + 0.2 * b)


def test_clamp_to_samples_fits_a_window_of_unequal_sizes_into_the_epoch():
    from flodl.runtime.controller.dispatch import EpochCursor, clamp_to_samples

    assert clamp_to_samples([10, 10], [64, 16], 10_000) == [10, 10]
    counts = clamp_to_samples([10, 10], [64, 16], 400)  # 800 asked, 400 left
    assert counts == [5, 5]
    cursor = EpochCursor(0, 400, 32)
    chunks = cursor.take(counts, [64, 16])
    assert chunks == [((0, 320),), ((320, 80),)] and cursor.done


def _drive_sized(ctl, links, sizes, ms_per_sample):
    """Fake ranks that take ``ms_per_sample[r]`` per sample of their own batch size."""
    from flodl.runtime.controller.dispatch import count_batches
    from flodl.runtime.wire.messages import Final, Report, Settled, Stop

    done, stopped = [0, 0], [False, False]
    while not all(stopped):
        for rank, link in enumerate(links):
            while done[rank] < len(link.sent):
                msg = link.sent[done[rank]]
                done[rank] += 1
                if isinstance(msg, Plan):
                    for w in msg.windows:
                        b = count_batches(w.chunks, sizes[rank])
                        n = sum(s for _, s in w.chunks)
                        ms = n * ms_per_sample[rank]
                        report = Report(rank, w.index, w.epoch, w.chunks, b, n, ms, 1.0 * b, b)
                        ctl.handle(rank, report)
                        if w.settle:  # its averaging held
                            ctl.handle(rank, Settled(rank, w.index))
                elif isinstance(msg, Stop):
                    stopped[rank] = True
                    if msg.send_state:
                        ctl.handle(rank, Final(rank, {}, {}))


@pytest.mark.parametrize(
    ("ms_per_sample", "share"), [((0.1, 0.1), 0.5), ((0.1, 0.4), 0.8)], ids=["equal_rate", "4x"]
)
def test_cadence_shares_follow_samples_per_second_with_unequal_batch_sizes(ms_per_sample, share):
    """Batch 64 vs 16. At equal samples/s (the big rank's batch takes 4x as long) ElChe's counts,
    which equalise time per window, split the samples evenly; at equal ms per *batch* (the small
    rank 4x slower per sample) they split 0.8 / 0.2: shares follow samples/s either way."""
    from flodl.config import ElCheConfig, TrainerConfig
    from flodl.runtime.controller.controller import Controller
    from flodl.runtime.wire.messages import Ready

    from .test_controller import FakeLink

    cfg = TrainerConfig(num_epochs=4, batch_size=32, elche=ElCheConfig(anchor=4))
    ctl = Controller(cfg, 2, [1.0, 1.0], has_eval=False)
    links = [FakeLink(), FakeLink()]
    for rank, link in enumerate(links):
        ctl.attach(rank, link)
    for rank, size in enumerate((64, 16)):
        ctl.handle(rank, Ready(rank, "sig", 2, 1.0, "cpu", 4000, batch_size=size))
    _drive_sized(ctl, links, (64, 16), ms_per_sample)
    last = ctl.aggregator.closed_epochs[-1]
    samples = [r["samples"] for r in last.per_rank]
    assert samples[0] / sum(samples) == pytest.approx(share, abs=0.05)
    rate = [s / r["compute_ms"] for s, r in zip(samples, last.per_rank, strict=True)]
    assert samples[0] / samples[1] == pytest.approx(rate[0] / rate[1], rel=0.1)  # ∝ samples/s
    assert all(ctl.planner.coverage.exact(e) for e in range(4))
