"""RunLogger writes what TensorBoard reads back: tags per directory, values as logged."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from flodl.monitor.metrics import EpochMetrics, SyncEvent
from flodl.monitor.tensorboard import RunLogger


def _read(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _values(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]


def _sync(index: int, divergence: float | None) -> SyncEvent:
    return SyncEvent(
        index=index,
        epoch=0,
        wall_s=1.0 + index,
        anchor=10 + index,
        counts=[20, 10],
        batches=[21 + index, 10],
        compute_ms=[100.0, 98.0],
        sync_ms=4.5 + index,
        overhead=0.045,
        divergence=divergence,
        verdict="stable",
        phase="warmup",
    )


def _epoch(epoch: int, eval_value: float | None) -> EpochMetrics:
    return EpochMetrics(
        epoch=epoch,
        avg_loss=1.0 / (epoch + 1),
        epoch_ms=1234.0,
        scalars={"grad_norm": 0.5},
        per_rank=[{"loss": 0.9}, {"loss": 1.1}],
        per_rank_throughput=[800.0, 400.0],
        per_rank_batch_share=[0.67, 0.33],
        syncs=7,
        anchor=12,
        overhead=0.05,
        eval_value=eval_value,
        lr=0.01,
    )


@pytest.fixture
def logged(tmp_path: Path) -> Path:
    with RunLogger(tmp_path, world_size=2) as log:
        log.sync_event(_sync(0, None))
        log.sync_event(_sync(1, 0.02))
        log.epoch(_epoch(0, None))
        log.epoch(_epoch(1, 0.94))
        log.hparams(
            {"elche.mode": "nccl_cadence", "anchor": 10, "relax_up": False, "max_batch_diff": None},
            {"final/loss": 0.5, "final/eval": None},
        )
        log.config_text("trainer:\n  num_epochs: 2\n")
        log.flush()
    return tmp_path / "tb"


def test_aggregate_scalars(logged: Path) -> None:
    acc = _read(logged)
    assert _values(acc, "elche/sync_ms") == [(0, 4.5), (1, 5.5)]
    assert _values(acc, "elche/divergence") == [(1, 0.02)]  # None is skipped, not logged as 0
    assert _values(acc, "loss/train") == [(0, 1.0), (1, 0.5)]
    assert _values(acc, "eval/value") == [(1, 0.94)]
    assert _values(acc, "time/epoch_ms") == [(0, 1234.0), (1, 1234.0)]
    assert _values(acc, "lr") == [(0, 0.01), (1, 0.01)]
    assert _values(acc, "scalars/grad_norm") == [(0, 0.5), (1, 0.5)]
    # Sync-indexed and epoch-indexed anchors use separate tags (one step axis per tag).
    assert _values(acc, "elche/anchor") == [(0, 10), (1, 11)]
    assert _values(acc, "epoch/anchor") == [(0, 12), (1, 12)]
    assert _values(acc, "epoch/overhead") == [(0, 0.05), (1, 0.05)]
    assert _values(acc, "final/loss") == [(0, 0.5)]
    assert "final/eval" not in acc.Tags()["scalars"]


def test_per_rank_scalars_live_in_rank_dirs(logged: Path) -> None:
    assert sorted(p.name for p in logged.iterdir() if p.is_dir()) == ["rank_0", "rank_1"]
    for rank, (loss, tput, share, batches) in enumerate(
        [(0.9, 800.0, 0.67, [21, 22]), (1.1, 400.0, 0.33, [10, 10])]
    ):
        acc = _read(logged / f"rank_{rank}")
        assert _values(acc, "loss/train") == [(0, loss), (1, loss)]
        assert _values(acc, "throughput/samples_per_s") == [(0, tput), (1, tput)]
        assert _values(acc, "share/batch") == [(0, share), (1, share)]
        assert _values(acc, "elche/batches") == [(0, batches[0]), (1, batches[1])]
    # One writer per directory: exactly one event file each.
    assert len(list(logged.glob("events.out.tfevents.*"))) == 1
    assert len(list((logged / "rank_0").glob("events.out.tfevents.*"))) == 1


def test_hparams_and_config_text(logged: Path) -> None:
    acc = _read(logged)
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = start.session_start_info.hparams
    assert hp["elche.mode"].string_value == "nccl_cadence"
    assert hp["anchor"].number_value == 10
    assert hp["relax_up"].bool_value is False
    assert hp["max_batch_diff"].string_value == "none"
    exp = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    assert [m.name.tag for m in exp.experiment.metric_infos] == ["final/loss"]
    (text,) = acc.Tensors("config/text_summary")
    assert text.tensor_proto.string_val[0].decode() == "```yaml\ntrainer:\n  num_epochs: 2\n```"


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    log = RunLogger(tmp_path, world_size=2, enabled=False)
    log.sync_event(_sync(0, 0.1))
    log.epoch(_epoch(0, 0.5))
    log.hparams({"a": 1}, {"m": 1.0})
    log.config_text("x: 1")
    log.flush()
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_close_is_idempotent_and_final(tmp_path: Path) -> None:
    log = RunLogger(tmp_path, world_size=1)
    log.epoch(_epoch(0, None))
    log.close()
    log.close()
    log.epoch(_epoch(1, None))  # after close: ignored, no new event file
    log.flush()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    assert _values(_read(tmp_path / "tb"), "loss/train") == [(0, 1.0)]


def test_eval_metrics_telemetry_and_steps_get_their_own_tags(tmp_path: Path) -> None:
    m = _epoch(1, 0.9)
    m.eval_metrics = {"eval_loss": 0.3, "accuracy": 0.9}
    m.per_rank = [
        {"loss": 0.9, "busy_fraction": 0.8, "data_wait_fraction": 0.05, "peak_mem_mb": 512}
    ]
    with RunLogger(tmp_path, world_size=1) as log:
        log.epoch(m)
        log.steps(0, ((10, 0.7, 1e-3), (20, 0.6, 5e-4)))
        log.flush()
    acc = _read(tmp_path / "tb")
    assert _values(acc, "eval/eval_loss") == [(1, 0.3)] and _values(acc, "eval/accuracy") == [
        (1, 0.9)
    ]
    rank = _read(tmp_path / "tb" / "rank_0")
    assert _values(rank, "telemetry/peak_mem_mb") == [(1, 512.0)]
    assert _values(rank, "telemetry/data_wait_fraction") == [(1, 0.05)]
    assert _values(rank, "step/loss") == [(10, 0.7), (20, 0.6)]
    assert _values(rank, "step/lr") == [(10, 1e-3), (20, 5e-4)]
