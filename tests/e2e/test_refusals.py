"""Bad input refused in the launcher before any rank starts, exit 2, one line naming the key,
the value and the fix, no traceback.

A few refusals go through the real run.py (exit code, one line, what was imported); the rest
are checked in this process through the launcher's own sequence of checks (compose, then
:func:`flodl.cli.sweep.check_job`, then the per-run checks of ``Job``), which is what run.py runs
before it starts a rank, without paying a Python start-up and torch's import for each.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flodl.config import ConfigError

pytestmark = pytest.mark.light  # refusals start no rank

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "torchmetrics", "scipy")


def refused(args: list[str], tmp_path: Path) -> tuple[str, set[str]]:
    """Run ``python -X importtime run.py ARGS``: the error line and which of HEAVY it imported."""
    sweep = tmp_path / "sweep"
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "run.py", *args, f"hydra.sweep.dir={sweep}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, (args, out.stdout[-2000:], out.stderr[-2000:])
    lines = out.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert [line for line in lines if not line.startswith(("error:", "import time:"))] == []
    assert "Traceback" not in out.stdout + out.stderr
    assert not list(sweep.glob("**/rank_*.log")), args  # no rank was started
    assert not list(sweep.glob("**/model.pt"))
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import")}
    return errors[0], imported & set(HEAVY)


def test_run_py_refusals_exit_2_and_import_only_what_they_need(tmp_path):
    """Pure-config refusals exit before torch is imported; a factory's refusal needs torch, but
    never the metrics (torchmetrics pulls scipy, ~0.7 s)."""
    cases = {
        "trainer.num_epochs=abc": ("trainer.num_epochs=abc: Input should be a valid integer", []),
        "optimizer.lr=abc": ("optimizer.lr=abc: torch.optim.Adam expects float", ["torch"]),
        "+model.hiden=3": (
            "model.hiden: unknown argument of flodl.recipes.models.MLP "
            "(did you mean model.hidden?)",
            ["torch"],
        ),
    }
    for i, (override, (expected, heavy)) in enumerate(cases.items()):
        line, imported = refused([override], tmp_path / str(i))
        assert expected in line, line
        assert sorted(imported) == heavy, (override, imported)


def test_a_refusal_after_the_config_checks_exits_2_through_run_py(tmp_path):
    """resume_from is checked per run, once the factories' dry build gave the architecture."""
    line, _ = refused([f"trainer.resume_from={tmp_path}/none"], tmp_path / "run")
    assert f"trainer.resume_from={tmp_path}/none: no checkpoint" in line, line


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "trainer.nmu_epochs=3",
            "trainer.nmu_epochs: unknown key (did you mean trainer.num_epochs?)",
        ),
        ("model=nonexistent", "model"),
        (  # a section's key misspelt without Hydra's +: the section's keys and the likely one
            "model.hiden=3",
            "model.hiden: no such key (did you mean model.hidden?); model has input_shape, "
            "num_classes, hidden; a new key is added with +model.hiden=VALUE",
        ),
    ],
)
def test_hydra_composition_errors_exit_2_through_run_py(tmp_path, override, expected):
    """What Hydra refuses itself (an unknown key, a missing config group option) is turned into
    exit 2 by run.py, before any rank; an unknown key in one line with the likely key."""
    sweep = tmp_path / "sweep"
    out = subprocess.run(
        [sys.executable, "run.py", override, f"hydra.sweep.dir={sweep}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert expected in out.stderr
    if override != "model=nonexistent":
        assert out.stderr.strip().startswith("error:"), out.stderr
        assert out.stderr.strip().count("\n") == 0, out.stderr  # one line, no traceback
    assert not list(tmp_path.glob("**/rank_*.log"))  # no rank was started


def launcher_refusal(overrides: list[str]) -> str:
    """What run.py checks before starting a rank, in this process; the refusal's message."""
    from hydra import compose, initialize_config_dir

    from flodl.cli.sweep import check_job
    from flodl.placement.topology import resolve_topology
    from flodl.preflight import check_run

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(ConfigError) as info:
        checked = check_job(cfg)  # its signature is what train() passes on to the run's checks
        config = checked.config
        world = resolve_topology(config, probe_hosts=False).world_size
        check_run(config, world, checked.signature)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    return message


def test_launcher_refusals_name_key_value_and_fix(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    cases = {
        "model.hidden=-1": "model: flodl.recipes.models.MLP(input_shape=[1, 28, 28], "
        "num_classes=10, hidden=-1) refused on a dry build: ValueError: MLP: hidden=-1: "
        "must be >= 1; fix the model.* values",
        "model._target_=tests.e2e.faulty.PretrainedBackbone": (
            "FileNotFoundError: pretrained/backbone.pt: no such file"
        ),
        "model._target_=flodl.recipes.models.Nope": "model._target_=flodl.recipes.models.Nope: "
        "module 'flodl.recipes.models' has no attribute 'Nope'",
        "trainer.batch_size=5000": "trainer.batch_size=5000: larger than the dataset (4000 "
        "training samples",
        f"trainer.resume_from={tmp_path}/none": f"trainer.resume_from={tmp_path}/none: no "
        "checkpoint",
        "trainer.save_path=''": "trainer.save_path=: empty",
        f"trainer.save_path={tmp_path}/a_file/ckpt/run": f"trainer.save_path={tmp_path}/a_file/"
        "ckpt/run: cannot write",
        "cluster.controller.port=65535": "cluster.controller.port=65535: must be at most 65534",
        "trainer.callback_policy.kind=rank trainer.callback_policy.rank=2": (
            "trainer.callback_policy.rank=2: this run has 2 rank(s)"
        ),
        "trainer.precision=16-mixed": "trainer.precision=16-mixed: rank(s) [0, 1] run on CPU",
        "elche.mode=fast": "elche.mode=fast",
        "trainer.batch_size=0": "trainer.batch_size=0",
        "cluster.speeds=[1,-1]": "cluster.speeds=[1, -1]",
    }
    for overrides, expected in cases.items():
        assert expected in launcher_refusal(overrides.split()), overrides


def test_datasets_the_controller_cannot_plan_are_refused():
    cases = {
        "dataset._target_=tests.e2e.faulty.StreamOnly": "IterableDataset without shards; the "
        "controller plans which samples each rank trains: give a map-style dataset or "
        "flodl.data.streams.ShardStream(shards",
        "dataset._target_=tests.e2e.faulty.wrapped_loader": "builds a DataLoader",
        "loader.prefetch_factor=4": "loader.prefetch_factor=4 (rank 0): prefetching needs",
    }
    for override, expected in cases.items():
        assert expected in launcher_refusal([override]), override


def test_a_save_path_another_job_is_saving_to_exits_2_through_run_py(tmp_path):
    """Was: two jobs on one save_path replaced each other's bundles, both 'saved'. The stem's
    lock (flodl/checkpoint/lock.py) is held here as a running job holds it."""
    from flodl.checkpoint.lock import SaveLock

    stem = tmp_path / "ckpt" / "run"
    held = SaveLock.take(str(stem), tmp_path / "first_job")
    assert held is not None
    try:
        line, _ = refused([f"trainer.save_path={stem}"], tmp_path / "second")
    finally:
        held.release()
    assert f"trainer.save_path={stem}: another job is saving to {stem}" in line, line
    assert f"job dir {tmp_path / 'first_job'}" in line, line
    assert not list((tmp_path / "ckpt").glob("run*.pt"))


@pytest.mark.parametrize("taken", [0, 1])
def test_a_taken_controller_port_exits_2_naming_port_and_knob(tmp_path, taken):
    """Was: exit 1, '[Errno 98] Address already in use', naming neither. ``taken`` 1: the
    store's port (controller.port + 1) is the one in use."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1] - taken
        line, _ = refused(
            ["cluster=cpu_rig", f"cluster.controller.port={port}"], tmp_path / str(taken)
        )
    assert f"cluster.controller.port={port}: port {port + taken} on 127.0.0.1" in line, line
    assert "is in use; choose a free port, or 0" in line, line
