"""What one real 2-rank job leaves for observability: TensorBoard event files read back and
checked against ``summary.json``, the trace and the handle's metrics; the job's own dashboard
(``logger.serve``) while it runs and after; and ``Monitor`` from the Python API.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.monitor.dashboard import port_in_use
from flodl.recipes.steps import accuracy, classification_step
from tests.integration.helpers import data, model_factory, optim_factory

EPOCHS = 2
WORLD = 2
AGGREGATE_TAGS = {
    "loss/train",
    "eval/value",
    "lr",
    "time/epoch_ms",
    "epoch/anchor",
    "epoch/overhead",
    "elche/anchor",
    "elche/overhead",
    "elche/sync_ms",
    "elche/divergence",
}
RANK_TAGS = {
    "loss/train",
    "throughput/samples_per_s",
    "share/batch",
    "elche/batches",
    "telemetry/busy_fraction",
    "telemetry/data_wait_fraction",
    "telemetry/pace_overrun_fraction",
    "telemetry/peak_mem_mb",
}
HPARAM_METRICS = {"final_loss", "eval", "wall_s", "samples_per_s", "final/eval"}  # + each metric


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for loopback
    with opener.open(url, timeout=timeout) as resp:
        return resp.status, resp.read()


def tensorboard_children() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "tensorboard" in " ".join(
                child.cmdline()
            ):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


class Events:
    """The scalars of one TensorBoard directory, read back from its event file."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.backend.event_processing import event_accumulator as ea

        self.logdir = logdir
        self.acc = ea.EventAccumulator(
            str(logdir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0}
        ).Reload()
        self.tags = set(self.acc.Tags()["scalars"])

    def steps(self, tag: str) -> list[int]:
        return [e.step for e in self.acc.Scalars(tag)]

    def values(self, tag: str) -> list[float]:
        return [e.value for e in self.acc.Scalars(tag)]

    def plugin(self, name: str) -> dict[str, bytes]:
        return self.acc.PluginTagToContent(name)


@dataclass
class Served:
    """What the job's dashboard answered from inside ``metrics_fn``, once per epoch."""

    port: int
    root_status: list[int] = field(default_factory=list)
    logdir: list[str] = field(default_factory=list)

    def probe(self, _metrics: Any) -> None:
        status, _ = http_get(f"http://127.0.0.1:{self.port}/")
        self.root_status.append(status)
        _, body = http_get(f"http://127.0.0.1:{self.port}/data/logdir")
        self.logdir.append(json.loads(body)["logdir"])


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory):
    """One 2-rank nccl_cadence job with TensorBoard on and its own dashboard (not kept)."""
    out = tmp_path_factory.mktemp("obs") / "job"
    served = Served(port=free_port())
    handle = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 1536))
        .eval_dataset(partial(data, "test"))
        .eval_fn(accuracy)
        .batch_size(32)
        .num_epochs(EPOCHS)
        .elche(ElCheConfig(mode="nccl_cadence"))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=WORLD, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=True, serve=served.port))
        .metrics_fn(served.probe)
        .output_dir(out)
        .run()
    )
    handle.join(timeout=240)
    # Recorded right after join: keep_serving is off, so the dashboard died with the run.
    after = {
        "port_in_use": port_in_use("127.0.0.1", served.port),
        "tensorboards": [p.pid for p in tensorboard_children()],
    }
    summary = json.loads((out / "summary.json").read_text())
    return handle, summary, out, served, after


@pytest.mark.slow
def test_one_event_file_per_directory(job) -> None:
    _, _, out, _, _ = job
    dirs = sorted(p for p in (out / "tb").rglob("*") if p.is_dir())
    assert [d.name for d in dirs] == [f"rank_{r}" for r in range(WORLD)]
    for logdir in [out / "tb", *dirs]:
        event_files = list(logdir.glob("events.out.tfevents.*"))
        assert len(event_files) == 1, (logdir, event_files)


@pytest.mark.slow
def test_aggregate_scalars_match_summary_and_trace(job) -> None:
    handle, summary, out, _, _ = job
    tb = Events(out / "tb")
    assert summary["status"] == "ok" and summary["world_size"] == WORLD
    assert tb.tags >= AGGREGATE_TAGS | HPARAM_METRICS, sorted(tb.tags)
    # Per-rank tags stay in the rank directories.
    assert not {"throughput/samples_per_s", "share/batch", "elche/batches"} & tb.tags

    epochs = handle.result.epochs
    assert len(epochs) == EPOCHS
    for tag in ("loss/train", "eval/value", "time/epoch_ms", "lr", "epoch/anchor"):
        assert tb.steps(tag) == list(range(1, EPOCHS + 1)), tag  # epochs count from 1
    assert tb.values("loss/train")[-1] == pytest.approx(summary["final_loss"], rel=1e-6)
    assert tb.values("eval/value")[-1] == pytest.approx(summary["eval_value"], rel=1e-6)
    assert tb.values("loss/train") == pytest.approx([m.avg_loss for m in epochs], rel=1e-6)
    assert tb.values("time/epoch_ms") == pytest.approx([m.epoch_ms for m in epochs], rel=1e-6)
    assert tb.values("epoch/anchor") == [float(m.anchor) for m in epochs]
    lrs = [m.lr for m in epochs]
    assert None not in lrs and tb.values("lr") == pytest.approx(lrs, rel=1e-6)

    # One elche/* step per averaging event, stepped by event index, equal to the trace's values.
    trace = [
        json.loads(line)
        for line in (out / "elche_trace.jsonl").read_text().splitlines()
        if line.strip()
    ]
    syncs = summary["syncs"]
    assert syncs > 0 and len(trace) == syncs
    for tag in ("elche/anchor", "elche/overhead", "elche/sync_ms"):
        assert tb.steps(tag) == list(range(syncs)), tag
    assert tb.values("elche/anchor") == [float(t["anchor"]) for t in trace]
    assert tb.values("elche/sync_ms") == pytest.approx([t["sync_ms"] for t in trace], rel=1e-6)
    assert tb.values("elche/overhead") == pytest.approx(
        [t["overhead"] for t in trace], rel=1e-6, abs=1e-9
    )
    assert sum(tb.values("elche/sync_ms")) / syncs == pytest.approx(
        summary["mean_sync_ms"], rel=1e-5
    )
    # Divergence is logged only for the events that measured one.
    measured = [(t["index"], t["divergence"]) for t in trace if t["divergence"] is not None]
    assert measured, "no event measured a divergence"
    assert tb.steps("elche/divergence") == [i for i, _ in measured]
    assert tb.values("elche/divergence") == pytest.approx([d for _, d in measured], rel=1e-6)
    assert [e.anchor for e in handle.result.events] == [t["anchor"] for t in trace]


@pytest.mark.slow
def test_per_rank_scalars_match_the_epoch_metrics(job) -> None:
    handle, summary, out, _, _ = job
    last = handle.result.epochs[-1]
    trace = [json.loads(line) for line in (out / "elche_trace.jsonl").read_text().splitlines()]
    batches_per_rank = []
    for rank in range(WORLD):
        tb = Events(out / "tb" / f"rank_{rank}")
        assert tb.tags == RANK_TAGS, (rank, sorted(tb.tags))
        for tag in ("loss/train", "throughput/samples_per_s", "share/batch"):
            assert tb.steps(tag) == list(range(1, EPOCHS + 1)), (rank, tag)
        assert tb.values("share/batch")[-1] == pytest.approx(
            last.per_rank_batch_share[rank], rel=1e-6
        )
        assert tb.values("loss/train")[-1] == pytest.approx(last.per_rank[rank]["loss"], rel=1e-6)
        assert tb.values("throughput/samples_per_s")[-1] == pytest.approx(
            last.per_rank_throughput[rank], rel=1e-6
        )
        assert tb.steps("elche/batches") == list(range(summary["syncs"]))
        assert tb.values("elche/batches") == [float(t["batches"][rank]) for t in trace]
        batches_per_rank.append(sum(tb.values("elche/batches")))
    # Every batch a rank did was averaged: the summary's shares are the events' batch shares.
    total = sum(batches_per_rank)
    assert [b / total for b in batches_per_rank] == pytest.approx(
        summary["per_rank_batch_share"], rel=1e-6
    )
    # Shares of one epoch add up to one; the slow rank (speed 0.5) did fewer batches.
    assert sum(last.per_rank_batch_share) == pytest.approx(1.0)
    assert batches_per_rank[1] < batches_per_rank[0]


@pytest.mark.slow
def test_hparams_record_mode_knobs_and_final_metrics(job) -> None:
    from tensorboard.plugins.hparams import plugin_data_pb2

    _, summary, out, _, _ = job
    tb = Events(out / "tb")
    content = tb.plugin("hparams")
    assert {
        "_hparams_/experiment",
        "_hparams_/session_start_info",
        "_hparams_/session_end_info",
    } <= set(content)
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]
    ).experiment
    assert {m.name.tag for m in experiment.metric_infos} == HPARAM_METRICS
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]
    ).session_start_info
    hparams = start.hparams
    assert hparams["mode"].string_value == "nccl_cadence"
    assert hparams["world_size"].number_value == WORLD
    assert hparams["batch_size"].number_value == 32
    assert {"anchor", "overhead_target"} <= set(hparams)
    # The HParams view reads each metric from the scalar of the same tag.
    assert tb.values("final_loss") == pytest.approx([summary["final_loss"]], rel=1e-6)
    assert tb.values("eval") == pytest.approx([summary["eval_value"]], rel=1e-6)
    assert tb.values("wall_s") == pytest.approx([summary["wall_s"]], rel=1e-6)
    assert tb.values("samples_per_s") == pytest.approx([summary["samples_per_s"]], rel=1e-6)
    # The Python API's validated config in the Text tab, as a Hydra job's composed one is.
    tag = next(t for t in tb.plugin("text") if t.startswith("config"))
    (event,) = tb.acc.Tensors(tag)
    body = event.tensor_proto.string_val[0].decode()
    assert "mode: nccl_cadence" in body and "batch_size: 32" in body


@pytest.mark.slow
def test_job_dashboard_serves_its_tb_dir_while_running_then_stops(job) -> None:
    _, _, out, served, after = job
    assert served.root_status == [200] * EPOCHS  # answered at every epoch, during the run
    assert {Path(d).resolve() for d in served.logdir} == {(out / "tb").resolve()}
    assert not after["port_in_use"], "the dashboard outlived its run (keep_serving is off)"
    assert after["tensorboards"] == []


@pytest.mark.slow
def test_monitor_serves_loopback_and_stop_frees_the_port(tmp_path: Path) -> None:
    from flodl.monitor import Monitor

    monitor = Monitor(tmp_path / "runs")
    try:
        url = monitor.serve(0)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/")
        port = int(url.rsplit(":", 1)[1].rstrip("/"))
        assert port > 0 and monitor.url == url
        assert monitor.serve(0) == url  # a second serve() reuses the running server
        status, body = http_get(url)
        assert status == 200 and body  # TensorBoard's page
        _, logdir = http_get(url + "data/logdir")
        assert Path(json.loads(logdir)["logdir"]).resolve() == (tmp_path / "runs").resolve()
        assert port_in_use("127.0.0.1", port)
        assert len(tensorboard_children()) == 1
    finally:
        monitor.stop()
    assert monitor.url is None
    assert not port_in_use("127.0.0.1", port)
    assert tensorboard_children() == []
    with pytest.raises(OSError):
        http_get(url, timeout=2.0)
    monitor.stop()  # idempotent


@pytest.mark.slow
def test_python_api_port_in_use_fails_before_any_rank(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        handle = (
            Trainer.builder(model_factory, optim_factory, classification_step)
            .dataset(partial(data, "train", 256))
            .batch_size(32)
            .num_epochs(1)
            .cluster(ClusterConfig(kind="cpu_rig", ranks=WORLD, speeds=[1.0, 0.5]))
            .logger(LoggerConfig(progress="off", serve=port))
            .output_dir(tmp_path / "job")
            .run()
        )
        with pytest.raises(OSError, match=rf"logger.serve={port}: port already in use"):
            handle.join(timeout=120)
    assert not list(tmp_path.glob("**/rank_*.log"))  # no rank was started
    assert not (tmp_path / "job" / "tb").exists()  # nor any writer
    assert tensorboard_children() == []
