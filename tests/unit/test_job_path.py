"""One pass from ``python run.py`` to the job: each job validated once, its task function
flodl's own (run.py's ``main`` is not entered again), the follower decided in one function."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flodl import config, preflight
from flodl.cli import app, sweep
from flodl.runtime.wire.rank_env import ExternalRole, is_follower, placed_cohort

ROOT = Path(__file__).resolve().parents[2]
ROLE = ExternalRole("torchrun", 1, 2, 1, "127.0.0.1", 29500, "cpu")


@pytest.mark.parametrize(
    ("role", "placed", "follower"),
    [
        (None, False, False),
        (replace(ROLE, rank=0, world_size=1), False, False),  # torchrun --nproc-per-node=1
        (replace(ROLE, rank=0), True, False),  # rank 0 runs the job and hosts the controller
        (ROLE, True, True),
    ],
)
def test_the_follower_is_decided_in_one_function(role, placed, follower):
    assert placed_cohort(role) is placed
    assert is_follower(role) is follower
    assert not placed_cohort(role, solo=True)  # solo trains on rank 0 alone: no cohort


@pytest.fixture(autouse=True)
def _no_hydra_config_left():
    """_compose sets Hydra's process-wide HydraConfig; other tests must not see it."""
    yield
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None


def _compose(overrides: list[str], job_dir: Path) -> Any:
    """A composed job as the launcher holds it (with its hydra node, HydraConfig set)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(job_dir)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    return cfg


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the validations wherever they are bound."""
    calls = {"schema": 0, "trainer_config": 0, "factories": 0, "targets": 0}

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    schema = counted("schema", config.validate_run_config)
    monkeypatch.setattr(config, "validate_run_config", schema)
    monkeypatch.setattr(sweep, "validate_run_config", schema)
    bag = counted("trainer_config", config.RunConfig.trainer_config)
    monkeypatch.setattr(config.RunConfig, "trainer_config", bag)
    monkeypatch.setattr(
        preflight, "check_factories", counted("factories", preflight.check_factories)
    )
    targets = counted("targets", preflight.check_task_targets)
    monkeypatch.setattr(preflight, "check_task_targets", targets)
    return calls


def test_a_job_is_validated_once_and_run_py_is_not_entered_again(monkeypatch, tmp_path):
    """The launcher's checks (check_job) hand the job its validated config: running it checks
    nothing again, and its task function is app.train, not run.py's main a second time."""
    calls = _counting(monkeypatch)
    job_cfg = _compose(["dataset=digits", "trainer.num_epochs=1"], tmp_path)
    checked = sweep.check_job(job_cfg)
    assert calls == {"schema": 1, "trainer_config": 1, "factories": 1, "targets": 1}

    started: dict[str, Any] = {}

    def run(*args: Any, **kwargs: Any) -> Any:
        started.update(kwargs, cfg=args[3])
        return SimpleNamespace(join=lambda: None, summary=None)

    monkeypatch.setattr("flodl.trainer.Trainer.run", run)
    row = app.train(job_cfg, checked=checked).row
    assert calls == {"schema": 1, "trainer_config": 1, "factories": 1, "targets": 1}
    assert started["cfg"] is checked.config and row["status"] == "failed"  # no summary: stub
    assert started["run_info"]["model_signature"] == checked.signature

    tasks: list[Any] = []

    def run_job(**kwargs: Any) -> Any:
        tasks.append(kwargs["task_function"])
        raise StopIteration  # enough: what the launcher would run is known

    class Launcher:
        task_function = staticmethod(lambda cfg: pytest.fail("run.py's main entered again"))
        rows: dict = {}

    monkeypatch.setattr("hydra.core.utils.run_job", run_job)
    with pytest.raises(StopIteration):
        sweep._run_jobs(Launcher(), None, [(0, [], job_cfg, checked)], tmp_path)
    assert tasks[0].func is app.train and tasks[0].keywords == {"checked": checked}


def test_a_sweep_with_a_dashboard_still_validates_each_job_once(monkeypatch, tmp_path):
    """Found by review: the sweep serves one dashboard, so each job's ``logger.serve`` is unset
    after its check; the job then differed from what was checked and was validated again (the
    factories' dry build included). The change is made in both now."""
    calls = _counting(monkeypatch)
    job_cfg = _compose(["dataset=digits", "trainer.num_epochs=1", "logger.serve=6006"], tmp_path)
    checked = sweep.unserved(job_cfg, sweep.check_job(job_cfg))
    assert checked.run.logger.serve is None and checked.config.logger.serve is None
    started: dict[str, Any] = {}

    def run(*args: Any, **kwargs: Any) -> Any:
        started.update(cfg=args[3])
        return SimpleNamespace(join=lambda: None, summary=None)

    monkeypatch.setattr("flodl.trainer.Trainer.run", run)
    app.train(job_cfg, checked=checked)
    assert calls == {"schema": 1, "trainer_config": 1, "factories": 1, "targets": 1}
    assert started["cfg"] is checked.config  # no dashboard of its own


def test_another_launchers_job_validates_itself_once(monkeypatch, tmp_path):
    """Without the flodl launcher (hydra/launcher=basic, joblib, submitit) run.py's main calls
    app.train(cfg), which validates: once."""
    calls = _counting(monkeypatch)
    job_cfg = _compose(["dataset=digits"], tmp_path)
    stub = SimpleNamespace(join=lambda: None, summary=None)
    monkeypatch.setattr("flodl.trainer.Trainer.run", lambda *a, **k: stub)
    app.train(job_cfg)
    assert calls == {"schema": 1, "trainer_config": 1, "factories": 1, "targets": 1}


def test_a_job_that_resolves_differently_inside_is_checked_again(monkeypatch, tmp_path):
    """A value that resolves per job (``${hydra:...}``) may differ from the launcher's check:
    the job then validates what it really runs."""
    job_cfg = _compose(["dataset=digits"], tmp_path)
    checked = sweep.check_job(job_cfg)
    stale = replace(checked, data={**checked.data, "seed_note": "resolved elsewhere"})
    calls = _counting(monkeypatch)
    stub = SimpleNamespace(join=lambda: None, summary=None)
    monkeypatch.setattr("flodl.trainer.Trainer.run", lambda *a, **k: stub)
    app.train(job_cfg, checked=stale)
    assert calls["schema"] == 1 and calls["factories"] == 1
