"""Signals and teardown through run.py: graceful stops, a killed launcher, no leaks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flodl.checkpoint.bundle import load_bundle

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LONG = [
    "dataset=digits",
    "trainer.num_epochs=200",
    "trainer.batch_size=32",
    "cluster.warmup_steps=2",
    "logger.progress=lines",
    "logger.tensorboard=false",
]


def start(args: list[str], sweep_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "run.py", *args, f"hydra.sweep.dir={sweep_dir}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_epoch(proc: subprocess.Popen, timeout: float = 120) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("epoch 2/"):
            return lines
    raise AssertionError("no epoch line in time:\n" + "".join(lines[-30:]))


def rank_pids(proc: subprocess.Popen) -> list[int]:
    return [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            return True
        time.sleep(0.1)
    return False


def signalled_run(tmp_path: Path, sig: int) -> dict:
    """A 2-rank run.py run stopped by ``sig`` after its second epoch, with a save_path."""
    stem = tmp_path / "ckpt" / "run"
    proc = start([*LONG, f"trainer.save_path={stem}"], tmp_path / "sweep")
    wait_for_epoch(proc)
    ranks = rank_pids(proc)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    return {
        "stem": stem,
        "root": tmp_path,
        "ranks": ranks,
        "code": proc.returncode,
        "out": out,
        "stop_s": time.monotonic() - t0,
        "gone": gone_within(ranks, 1.0),
    }


@pytest.fixture(scope="module")
def sigint_run(tmp_path_factory) -> dict:
    """One SIGINT-stopped run, shared: its graceful bundle is also what a resume starts from."""
    return signalled_run(tmp_path_factory.mktemp("sigint"), signal.SIGINT)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_a_graceful_bundle_and_ends_every_rank(tmp_path, request, sig, code):
    run = request.getfixturevalue("sigint_run") if sig == signal.SIGINT else None
    run = run or signalled_run(tmp_path, sig)
    assert len(run["ranks"]) >= 2
    assert run["code"] == code, run["out"][-3000:]
    assert run["stop_s"] < 10
    assert run["gone"]
    _, meta = load_bundle(str(run["stem"]))
    assert meta.save_reason == "interrupted"
    assert 2 <= meta.epoch < 200
    summary = json.loads((run["root"] / "sweep" / "0" / "summary.json").read_text())
    assert summary["status"] == "interrupted"


def test_a_second_sigint_does_not_cut_the_save_short(tmp_path):
    """Ctrl-C twice, 50 ms apart (was: exit 130 with no bundle, no summary.json, no model.pt)."""
    stem = tmp_path / "ckpt" / "run"
    proc = start([*LONG, f"trainer.save_path={stem}"], tmp_path / "sweep")
    wait_for_epoch(proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    assert "stopping already" in out
    _, meta = load_bundle(str(stem))
    assert meta.save_reason == "interrupted"
    job = tmp_path / "sweep" / "0"
    assert json.loads((job / "summary.json").read_text())["status"] == "interrupted"
    assert (job / "model.pt").stat().st_size > 0
    assert (job / "elche_trace.jsonl").stat().st_size > 0


def test_killed_launcher_takes_its_ranks_with_it(tmp_path):
    proc = start(LONG, tmp_path / "sweep")
    wait_for_epoch(proc)
    ranks = rank_pids(proc)
    assert len(ranks) >= 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert gone_within(ranks, 10.0), "ranks outlived their launcher"


def test_resume_from_a_graceful_mid_epoch_bundle_covers_the_rest(tmp_path, sigint_run):
    stem = sigint_run["stem"]
    _, meta = load_bundle(str(stem))
    epochs = meta.epoch + 2
    args = [*LONG[:1], f"trainer.num_epochs={epochs}", *LONG[2:], f"trainer.resume_from={stem}"]
    done = subprocess.run(
        [sys.executable, "run.py", *args, f"hydra.sweep.dir={tmp_path / 'b'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "b" / "0" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["coverage_exact"] is True
    left = sum(size for _, size in meta.coverage["uncovered"])
    assert summary["samples_seen"] == left + 1437  # the rest of the saved epoch, then one more


def _ignore_sigint() -> None:  # what a shell does for `python run.py &` in a script
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("sig", "code", "ignored"),
    [(signal.SIGINT, 130, True), (signal.SIGHUP, 129, False)],
    ids=["sigint-inherited-ignored", "sighup"],
)
def test_background_sigint_and_sighup_stop_gracefully(tmp_path, sig, code, ignored):
    """In-process (no rank process: the launcher's handling is what is tested), with a bundle."""
    stem = tmp_path / "ckpt" / "run"
    args = [
        *(a for a in LONG if not a.startswith(("cluster.", "trainer.batch_size"))),
        "cluster=auto",
        "elche=solo",
        "trainer.device=cpu",
        "trainer.batch_size=128",
        "model.hidden=16",
        f"trainer.save_path={stem}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "run.py", *args, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ignore_sigint if ignored else None,
    )
    wait_for_epoch(proc)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == code, out[-3000:]
    _, meta = load_bundle(str(stem))
    assert meta.save_reason == "interrupted" and 2 <= meta.epoch < 200
    assert f"error: interrupted (exit {code})" in out
    summary = json.loads((tmp_path / "sweep" / "0" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
