"""Observability through ``run.py``: the served TensorBoard over HTTP, a taken port, the A/B
report of a real sweep against its jobs' summaries, and what reaches the console.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from flodl.monitor.dashboard import port_in_use

ROOT = Path(__file__).resolve().parents[2]
FAST = [
    "dataset=digits",
    "trainer.num_epochs=2",
    "trainer.batch_size=32",
    "cluster.warmup_steps=3",
    "logger.progress=lines",
]
DASHBOARD_LINE = re.compile(r"^dashboard: (http://(\S+):(\d+)/)$")
CONFIG_TAG = "config/text_summary"  # add_text("config") as torch's SummaryWriter names it
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)  loss ")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_py(
    args: list[str], sweep_dir: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "run.py", *args, f"hydra.sweep.dir={sweep_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


class Running:
    """``run.py`` in the background; both streams drained by threads into lists of lines."""

    def __init__(self, args: list[str], sweep_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "run.py", *args, f"hydra.sweep.dir={sweep_dir}"],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._drain, args=(stream, sink), daemon=True)
            for stream, sink in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _drain(stream: Any, sink: list[str]) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))

    def console(self) -> str:
        return "\n".join(self.stdout) + "\n--- stderr ---\n" + "\n".join(self.stderr)

    def wait_line(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        """The first stdout line matching ``pattern``; fails if the run exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.stdout):
                match = pattern.search(line)
                if match:
                    return match
            if self.proc.poll() is not None:
                time.sleep(0.5)  # let the readers catch the last lines
                for line in list(self.stdout):
                    if match := pattern.search(line):
                        return match
                pytest.fail(f"run.py exited ({self.proc.returncode}) early:\n{self.console()}")
            time.sleep(0.1)
        pytest.fail(f"no line matching {pattern.pattern!r} within {timeout_s} s:\n{self.console()}")

    def finish(self, timeout_s: float = 60) -> int:
        code = self.proc.wait(timeout=timeout_s)
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            self.proc.kill()
            self.finish()


def http_json(url: str, timeout: float = 5.0) -> Any:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, no proxy
    with opener.open(url, timeout=timeout) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def poll_json(url: str, ok: Any, deadline: float) -> Any:
    """Ask until ``ok(answer)``: TensorBoard reloads its logdir every 2 s in the background."""
    answer: Any = None
    while time.monotonic() < deadline:
        try:
            answer = http_json(url)
            if ok(answer):
                return answer
        except OSError as exc:  # URLError included: the server is slow under load
            answer = repr(exc)
        time.sleep(0.5)
    pytest.fail(f"{url} never satisfied the check; last answer: {answer}")


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- served TensorBoard ----------------------------------------------------------------------------
@pytest.mark.slow
def test_served_tensorboard_over_http_then_sigint_releases_everything(tmp_path: Path) -> None:
    port = free_port()
    run = Running([*FAST, f"logger.serve={port}", "logger.keep_serving=true"], tmp_path)
    try:
        match = run.wait_line(DASHBOARD_LINE, timeout_s=120)
        url, host, shown_port = match.groups()
        assert host == "127.0.0.1"  # loopback unless logger.host says otherwise
        assert int(shown_port) == port

        # The server is a child of the launcher, bound to loopback only.
        launcher = psutil.Process(run.proc.pid)
        tb = [
            p
            for p in launcher.children(recursive=True)
            if alive(p) and "tensorboard" in " ".join(p.cmdline())
        ]
        assert len(tb) == 1, [p.cmdline() for p in tb]
        listening = [c for c in tb[0].net_connections(kind="inet") if c.status == "LISTEN"]
        assert {(c.laddr.ip, c.laddr.port) for c in listening} == {("127.0.0.1", port)}

        # One dashboard over the sweep directory: the job's aggregate and rank runs appear.
        deadline = time.monotonic() + 60
        runs = {"0/tb", "0/tb/rank_0", "0/tb/rank_1"}
        poll_json(url + "data/runs", lambda r: runs <= set(r), deadline)
        tags = poll_json(
            url + "data/plugin/scalars/tags",
            lambda t: all("loss/train" in t.get(r, {}) for r in runs),
            deadline,
        )
        assert {"eval/value", "elche/anchor", "elche/sync_ms", "lr"} <= set(tags["0/tb"])
        for rank in (0, 1):
            assert {"throughput/samples_per_s", "share/batch"} <= set(tags[f"0/tb/rank_{rank}"])

        # The job ended (keep_serving holds the server); the served values are the job's.
        run.wait_line(re.compile(r"^dashboard still serving at "), timeout_s=240)
        epoch_lines = [line for line in run.stdout if EPOCH_LINE.match(line)]
        assert len(epoch_lines) == 2, run.console()
        first_epoch = run.stdout.index(epoch_lines[0])
        assert run.stdout.index(match.group(0)) < first_epoch  # served before training
        summary = json.loads((tmp_path / "0" / "summary.json").read_text())
        assert summary["status"] == "ok"
        query = urllib.parse.urlencode({"run": "0/tb", "tag": "loss/train"})
        deadline = time.monotonic() + 60
        points = poll_json(
            url + "data/plugin/scalars/scalars?" + query, lambda p: len(p) == 2, deadline
        )
        assert [step for _, step, _ in points] == [1, 2]  # TensorBoard steps are epochs from 1
        assert points[-1][2] == pytest.approx(summary["final_loss"], rel=1e-6)
        # The resolved config is served as text, for Hydra jobs.
        text_tags = poll_json(url + "data/plugin/text/tags", lambda t: "0/tb" in t, deadline)
        assert text_tags["0/tb"] == [CONFIG_TAG]

        children = [p for p in launcher.children(recursive=True) if alive(p)]
        run.proc.send_signal(signal.SIGINT)
        assert run.finish(timeout_s=60) == 0, run.console()
    finally:
        run.kill()
    leftover = [p.pid for p in children if alive(p)]
    assert leftover == [], f"processes outlived run.py: {leftover}"
    assert not port_in_use("127.0.0.1", port)


@pytest.mark.light
def test_port_in_use_fails_before_training(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_py([*FAST, f"logger.serve={port}"], tmp_path, timeout=120)
    assert out.returncode != 0, out.stdout
    assert f"logger.serve={port}" in out.stderr and "in use" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.glob("**/rank_*.log"))  # no rank was started
    assert not list(tmp_path.glob("**/summary.json"))
    assert not [line for line in out.stdout.splitlines() if EPOCH_LINE.match(line)]


# -- A/B report ------------------------------------------------------------------------------------
def _md_rows(md: str) -> dict[str, list[str]]:
    """The report table's rows by job: ``| 0 | nccl_sync | ... |`` -> cells."""
    rows = {}
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith("| job "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow
def test_sweep_ab_report_matches_job_summaries(tmp_path: Path) -> None:
    from matplotlib.image import imread
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.plugins.hparams import plugin_data_pb2

    args = ["-m", *FAST, "trainer.num_epochs=1", "elche.mode=nccl_sync,nccl_cadence"]
    out = run_py(args, tmp_path, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"A/B report: {tmp_path / 'ab_report.md'}" in out.stdout

    report = json.loads((tmp_path / "ab_report.json").read_text())
    rows = {r["job"]: r for r in report["rows"]}
    assert sorted(rows) == ["0", "1"]
    summaries = {j: json.loads((tmp_path / j / "summary.json").read_text()) for j in rows}
    assert {j: s["mode"] for j, s in summaries.items()} == {"0": "nccl_sync", "1": "nccl_cadence"}
    for job, row in rows.items():
        summary = summaries[job]
        assert row["status"] == summary["status"] == "ok"
        assert row["mode"] == summary["mode"]
        for key in ("final_loss", "eval_value", "wall_s", "mean_sync_ms", "samples_per_s"):
            assert row[key] == pytest.approx(summary[key], rel=1e-9, abs=1e-9), (job, key)
        assert row["syncs"] == summary["syncs"] > 0
        assert row["eval_metric"] == summary["eval_metric"] == "accuracy"
        assert row["idle_fraction"] == pytest.approx(summary["idle_fraction"], rel=1e-9)
        assert len(row["idle_fraction"]) == 2
        assert row["per_rank_batch_share"] == pytest.approx(summary["per_rank_batch_share"])
    # nccl_sync averages after every step: more syncs than cadence does in the same epoch.
    assert rows["0"]["syncs"] > rows["1"]["syncs"]

    # Speedup against the sweep's nccl_sync job.
    assert report["baseline"] == "0"
    assert report["differing_overrides"] == []  # only the mode differs, and it has its column
    assert rows["0"]["speedup"] == pytest.approx(1.0)
    assert rows["1"]["speedup"] == pytest.approx(rows["0"]["wall_s"] / rows["1"]["wall_s"])

    summary_rig = {job: summaries[job]["rig"] for job in rows}
    md = (tmp_path / "ab_report.md").read_text()
    assert "| job | mode | overrides | status | final loss | accuracy | wall s |" in md
    table = _md_rows(md)
    assert sorted(table) == ["0", "1"]
    for job, cells in table.items():
        row = rows[job]
        assert cells[1] == row["mode"] and cells[2] == "—" and cells[3] == "ok"
        assert cells[4] == f"{row['final_loss']:.4f}"
        assert cells[5] == f"{row['eval_value']:.4f}"
        assert cells[7] == str(row["syncs"])
        assert cells[9] == "/".join(f"{f:.2f}" for f in row["idle_fraction"])
        # CPU rig: the throughput matched to the baseline's nominal step (the sweep's jobs
        # each calibrated their own; the report compares them at one step).
        assert row["rig"] == summary_rig[job] and row["rig"]["nominal_step_ms"] > 0
        reference = rows["0"]["rig"]["nominal_step_ms"]
        matched = row["samples_per_s"] * row["rig"]["nominal_step_ms"] / reference
        assert row["samples_per_s_t_matched"] == pytest.approx(matched)
        assert cells[11] == f"{matched:.0f}"
        assert cells[12] == f"{row['speedup']:.2f}x"

    png = tmp_path / "ab_report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(png)
    assert image.ndim == 3 and image.shape[1] > 100 and image.shape[0] > 100
    assert float(image.std()) > 0  # not a blank canvas

    # Each job logged its hparams, so TensorBoard's HParams view compares the sweep's jobs.
    for job, summary in summaries.items():
        acc = ea.EventAccumulator(str(tmp_path / job / "tb")).Reload()
        start = plugin_data_pb2.HParamsPluginData.FromString(
            acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        ).session_start_info
        assert start.hparams["mode"].string_value == summary["mode"]
        final = acc.Scalars("final_loss")
        assert final[-1].value == pytest.approx(summary["final_loss"], rel=1e-6)


# -- console ---------------------------------------------------------------------------------------
CHATTY = '''
import logging

from flodl.recipes.models import MLP

log = logging.getLogger("chatty")


class ChattyMLP(MLP):
    """An MLP whose construction (in each rank) logs INFO and WARNING and prints a line."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        log.info("chatty-info built")
        log.warning("chatty-warning built")
        print("chatty-print built", flush=True)
'''


@pytest.mark.slow
def test_console_has_one_epoch_line_per_epoch_and_ranks_info_stays_in_rank_logs(
    tmp_path: Path,
) -> None:
    from tensorboard.backend.event_processing import event_accumulator as ea

    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "flodl_obs_chatty.py").write_text(CHATTY)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(modules), env.get("PYTHONPATH", "")) if p)
    sweep = tmp_path / "sweep"
    out = run_py([*FAST, "model._target_=flodl_obs_chatty.ChattyMLP"], sweep, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr

    # One plain line per epoch, from the launcher (not one per rank, no bar in a pipe).
    epoch_lines = [line for line in out.stdout.splitlines() if EPOCH_LINE.match(line)]
    assert [EPOCH_LINE.match(line).groups() for line in epoch_lines] == [("1", "2"), ("2", "2")]
    assert console.count("epoch 1/2") == 1 and console.count("epoch 2/2") == 1
    assert "\r" not in out.stdout and "\x1b[" not in out.stdout

    # A rank's INFO stays in rank_N.log; warnings and plain prints also reach the console.
    assert "chatty-info" not in console
    for rank in (0, 1):
        rank_log = (sweep / "0" / f"rank_{rank}.log").read_text()
        assert "INFO chatty: chatty-info built" in rank_log
        assert "WARNING chatty: chatty-warning built" in rank_log
        assert "chatty-print built" in rank_log
        assert out.stderr.count(f"[rank {rank}] WARNING chatty: chatty-warning built") == 1
        assert out.stderr.count(f"[rank {rank}] chatty-print built") == 1
    assert not [
        line for line in console.splitlines() if line.startswith("[rank") and " INFO " in line
    ]

    # The resolved config (with the override applied) is logged as text for a Hydra job.
    acc = ea.EventAccumulator(str(sweep / "0" / "tb"), size_guidance={ea.TENSORS: 0}).Reload()
    assert list(acc.PluginTagToContent("text")) == [CONFIG_TAG]
    text = acc.Tensors(CONFIG_TAG)[0].tensor_proto.string_val[0].decode()
    assert "_target_: flodl_obs_chatty.ChattyMLP" in text
    assert "mode: nccl_cadence" in text and "num_epochs: 2" in text
