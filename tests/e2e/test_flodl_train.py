"""``flodl train`` in a project of one's own (tmp_path): its ``conf/config.yaml`` lists flodl's
groups, its model, data and train step live in its own package; exit codes 0 / 1 / 2.

The project's config has no ``hydra:`` section and no callback: MULTIRUN, the flodl launcher and
the failed-job count come from flodl's entry itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flodl.cli.train import PACKAGED_CONFIG, hydra_argv, resolve_config_dir, split_args

PARTS = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))

    def forward(self, x):
        return self.net(x)


def data(split: str = "train", n: int = 256, num_classes: int = 2):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def step(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def broken_step(model, batch):
    raise RuntimeError("this train step is broken")
"""

CONFIG = """
defaults:
  - task: classification
  - optimizer: adam
  - elche: solo
  - cluster: cpu_rig
  - logger: default
  - trainer: default
  - _self_

model:
  _target_: myproj.parts.Net
  width: 8
dataset:
  _target_: myproj.parts.data
  num_classes: 2
task:
  train_step: myproj.parts.step
trainer:
  batch_size: 32
  num_epochs: 1
cluster:
  ranks: 1
  speeds: [1.0]
"""


def make_project(root: Path, config: str = CONFIG) -> Path:
    (root / "myproj").mkdir(parents=True)
    (root / "myproj" / "__init__.py").write_text("")
    (root / "myproj" / "parts.py").write_text(PARTS)
    (root / "conf").mkdir()
    (root / "conf" / "config.yaml").write_text(textwrap.dedent(config))
    return root


def flodl_command() -> list[str]:
    """The installed console script (what a pip user runs), else ``python -m flodl``."""
    script = Path(sys.executable).parent / "flodl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "flodl"]


def flodl_train(project: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    sweep = project / "out"
    return subprocess.run(
        [*flodl_command(), "train", *args, f"hydra.sweep.dir={sweep}"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_refused(out: subprocess.CompletedProcess, expected: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # one line, no traceback
    assert lines[0].startswith("error: "), lines[0]
    assert expected in lines[0], lines[0]
    return lines[0]


# -- refusals: exit 2, one line, before any rank -------------------------------------------------
@pytest.mark.light
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["trainer.nmu_epochs=2"],
            "trainer.nmu_epochs: unknown key (did you mean trainer.num_epochs?)",
        ),
        (["elche=nope"], "Could not find 'elche/nope'"),
        (["--config-dir", "nowhere"], "--config-dir=nowhere: no such directory"),
        (["--config-name=other"], "--config-name=other: no "),
    ],
)
def test_refused_configs_exit_2_in_one_line(tmp_path, args, expected):
    project = make_project(tmp_path / "proj")
    line = assert_refused(flodl_train(project, *args), expected)
    if args == ["elche=nope"]:  # names what exists, from flodl's packaged groups
        assert "nccl_cadence" in line and "_schema" not in line, line
    assert not list(project.glob("out/**/rank_*.log"))  # no rank was started


@pytest.mark.light
def test_a_knob_the_projects_config_does_not_have_says_how_to_get_it(tmp_path):
    project = make_project(tmp_path / "proj", CONFIG.replace("  - logger: default\n", ""))
    assert_refused(
        flodl_train(project, "logger.level=DEBUG"),
        "list one of flodl's logger options (all, csv, default, mlflow, wandb) in its defaults, "
        "or add the key with +logger.level=VALUE",
    )


@pytest.mark.light
def test_hydras_own_flags_work_and_show_flodls_groups_on_the_search_path(tmp_path):
    project = make_project(tmp_path / "proj")
    shown = flodl_train(project, "--cfg", "job", "elche=cpu_cadence")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "mode: cpu_cadence" in shown.stdout and "_target_: myproj.parts.Net" in shown.stdout
    info = flodl_train(project, "--info", "searchpath")
    assert info.returncode == 0, info.stderr[-2000:]
    assert "pkg://flodl.conf" in info.stdout and str(project / "conf") in info.stdout


@pytest.mark.light
def test_a_typo_in_the_projects_own_yaml_is_one_line_with_the_likely_key(tmp_path):
    project = make_project(tmp_path / "proj", CONFIG.replace("num_epochs: 1", "num_epohcs: 1"))
    line = assert_refused(
        flodl_train(project), "trainer.num_epohcs: unknown key (did you mean trainer.num_epochs?)"
    )
    number = CONFIG.splitlines().index("  num_epochs: 1") + 1
    assert line.endswith(f" (in conf/config.yaml:{number})"), line


# -- runs: exit 0 and 1 --------------------------------------------------------------------------
@pytest.mark.slow
def test_a_project_of_ones_own_trains_through_flodl_train(tmp_path):
    """Two CPU ranks, the project's own model/data/step imported from its root (sys.path)."""
    project = make_project(tmp_path / "proj")
    out = flodl_train(project, "elche=cpu_sync", "cluster.ranks=2", "cluster.speeds=[1.0,1.0]")
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    summary = json.loads((project / "out" / "0" / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert (project / "out" / "0" / "model.pt").exists()
    assert "error:" not in out.stderr


@pytest.mark.slow
def test_a_failed_job_exits_1_without_any_callback_in_the_projects_config(tmp_path):
    project = make_project(tmp_path / "proj")
    out = flodl_train(project, "task.train_step=myproj.parts.broken_step")
    assert out.returncode == 1, (out.stdout[-3000:], out.stderr[-3000:])
    assert "error: 1 job(s) failed" in out.stderr, out.stderr[-3000:]
    summary = json.loads((project / "out" / "0" / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert "this train step is broken" in json.dumps(summary)


@pytest.mark.slow
def test_the_flodl_launcher_itself_fails_the_command_in_a_users_own_hydra_entry(tmp_path):
    """A project's own ``@hydra.main`` (no flodl.cli.app.cli, no callback in its config) that
    picks hydra/launcher=flodl: a failed job still exits 1, counted by the launcher."""
    project = make_project(tmp_path / "proj")
    (project / "train.py").write_text(
        "import hydra\n"
        "from flodl.cli.app import train\n\n\n"
        '@hydra.main(version_base="1.3", config_path="conf", config_name="config")\n'
        "def main(cfg):\n"
        "    return train(cfg)\n\n\n"
        "main()\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=flodl",
            "task.train_step=myproj.parts.broken_step",
            f"hydra.sweep.dir={project / 'out'}",
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-2000:])
    summary = json.loads((project / "out" / "0" / "summary.json").read_text())
    assert summary["status"] == "failed", summary


@pytest.mark.slow
def test_optuna_on_a_failed_job_exits_1_in_one_line(tmp_path):
    """hydra-optuna-sweeper 1.3 crashes on a failed trial's NaN objective (optuna refuses the
    values it tells with state FAIL): still exit 1 (a job failed), one line, no traceback."""
    project = make_project(tmp_path / "proj")
    out = flodl_train(
        project,
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.direction=maximize",
        "optimizer.lr=interval(0.0005,0.005)",
        "task.train_step=myproj.parts.broken_step",
    )
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: the sweep stopped after 1 job(s), 1 failed: "
    ), out.stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_exits_130_with_the_job_marked_interrupted(tmp_path):
    project = make_project(tmp_path / "proj")
    proc = subprocess.Popen(
        [
            *flodl_command(),
            "train",
            "trainer.num_epochs=500",
            "logger.progress=lines",
            f"hydra.sweep.dir={project / 'out'}",
        ],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline and not any(x.startswith("epoch 2/") for x in lines[-1:]):
        lines.append(proc.stdout.readline())
    assert lines[-1].startswith("epoch 2/"), "".join(lines[-30:])
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    assert "error: interrupted (exit 130)" in out
    summary = json.loads((project / "out" / "0" / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary


# -- the command's pieces, in process ------------------------------------------------------------
@pytest.mark.light
def test_config_dir_and_name_are_taken_out_in_any_of_hydras_spellings():
    assert split_args(["-cd", "c", "--config-name=x", "a=1"]) == ("c", "x", ["a=1"])
    assert split_args(["--config-dir=c", "-cn", "x.yaml"]) == ("c", "x.yaml", [])
    assert split_args(["-m", "a=1,2"]) == (None, "config", ["-m", "a=1,2"])
    with pytest.raises(ValueError, match="--config-dir: needs a value"):
        split_args(["--config-dir"])
    with pytest.raises(ValueError, match="use --config-dir"):
        split_args(["--config-path", "x"])


@pytest.mark.light
def test_every_run_is_a_multirun_through_the_flodl_launcher_unless_named():
    assert hydra_argv(["a=1"]) == ["--multirun", "a=1", "hydra/launcher=flodl"]
    assert hydra_argv(["-m", "a=1,2"]) == ["-m", "a=1,2", "hydra/launcher=flodl"]
    assert hydra_argv(["hydra/launcher=basic"]) == ["--multirun", "hydra/launcher=basic"]
    # Hydra's informational flags take the place of the mode flag
    assert hydra_argv(["--cfg", "job"]) == ["--cfg", "job", "hydra/launcher=flodl"]
    assert hydra_argv(["--info=searchpath"])[0] == "--info=searchpath"


@pytest.mark.light
def test_the_default_config_dir_is_conf_here_else_flodls_own_job(tmp_path):
    assert resolve_config_dir(None, "config", tmp_path) == PACKAGED_CONFIG
    make_project(tmp_path / "proj")
    assert resolve_config_dir(None, "config", tmp_path / "proj") == str(tmp_path / "proj" / "conf")
    assert resolve_config_dir("conf", "config.yaml", tmp_path / "proj") == str(
        tmp_path / "proj" / "conf"
    )


@pytest.mark.light
def test_flodls_groups_compose_from_a_projects_own_config_dir(tmp_path):
    """The flodl_searchpath plugin: a project's config lists flodl's groups and overrides knobs."""
    from hydra import compose, initialize_config_dir

    from flodl.cli.sweep import check_job

    project = make_project(tmp_path / "proj")
    sys.path.insert(0, str(project))
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(project / "conf")):
            cfg = compose("config", overrides=["elche=nccl_cadence", "logger.csv=false"])
        assert cfg.elche.mode == "nccl_cadence" and cfg.cluster.kind == "cpu_rig"
        assert cfg.logger.csv is False and cfg.model._target_ == "myproj.parts.Net"
        assert check_job(cfg).run.elche.mode == "nccl_cadence"  # and it validates
    finally:
        sys.path.remove(str(project))


@pytest.mark.light
def test_another_hydra_app_in_the_environment_does_not_see_flodls_groups(tmp_path):
    """A Hydra app that never runs flodl's entry: its search path is its own (no
    pkg://flodl.conf), so ``+model=mlp`` there is a plain value, not flodl's model group."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text("x: 1\n")
    app = tmp_path / "app.py"
    app.write_text(
        "import hydra\n"
        f"@hydra.main(version_base='1.3', config_path={str(conf)!r}, config_name='config')\n"
        "def main(cfg):\n    print('composed', dict(cfg))\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    info = subprocess.run(
        [sys.executable, str(app), "--info", "searchpath"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert info.returncode == 0, info.stderr[-2000:]
    assert "pkg://flodl.conf" not in info.stdout
    other = subprocess.run(
        [sys.executable, str(app), "+model=mlp"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    # A plain value, not flodl's model group (whose option would compose a _target_ node).
    assert other.returncode == 0 and "'model': 'mlp'" in other.stdout, other.stderr[-2000:]
