"""Launcher-side checks before any rank: factory arguments, dry build, topology-bound knobs."""

from __future__ import annotations

import copy
import subprocess
import sys
import typing

import pytest

from flodl import preflight
from flodl.config import ConfigError, TrainerConfig, validate_run_config
from flodl.preflight import targets
from flodl.runtime.cohorts import fork_server

BASE = {
    "model": {"_target_": "flodl.recipes.models.MLP", "input_shape": [1, 8, 8], "num_classes": 10},
    "optimizer": {"_target_": "torch.optim.Adam", "lr": 1e-3},
    "dataset": {"_target_": "flodl.recipes.datasets.digits"},
    "task": {"train_step": "flodl.recipes.steps.classification_step"},
}


def refusal(**sections) -> str:
    data = copy.deepcopy(BASE)
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError) as info:
        preflight.check_factories(validate_run_config(data))
    return str(info.value)


def test_a_good_config_passes_and_yields_the_architecture_signature():
    first = preflight.check_factories(validate_run_config(BASE))
    wider = copy.deepcopy(BASE)
    wider["model"]["hidden"] = 64
    assert first and first != preflight.check_factories(validate_run_config(wider))


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"optimizer": {"lr": "abc"}}, "optimizer.lr=abc: torch.optim.Adam expects float"),
        (
            {"model": {"hiden": 3}},
            "model.hiden: unknown argument of flodl.recipes.models.MLP (did you ",
        ),
        ({"model": {"hidden": "wide"}}, "model.hidden=wide: flodl.recipes.models.MLP expects int"),
        ({"model": {"hidden": -1}}, "ValueError: MLP: hidden=-1: must be >= 1"),
        ({"optimizer": {"betas": [0.9, 2.0]}}, "Invalid beta parameter at index 1: 2.0"),
        ({"dataset": {"test_sise": 3}}, "dataset.test_sise: unknown argument"),
        (
            {"scheduler": {"_target_": "torch.optim.lr_scheduler.StepLR", "step_sze": 2}},
            "scheduler.step_sze: unknown argument of torch.optim.lr_scheduler.StepLR (did you "
            "mean scheduler.step_size?)",
        ),
        (
            {"model": {"_target_": "tests.e2e.faulty.PretrainedBackbone"}},
            "FileNotFoundError: pretrained/backbone.pt: no such file",
        ),
        ({"trainer": {"batch_size": 1500}}, "trainer.batch_size=1500: larger than the dataset"),
    ],
)
def test_bad_factory_input_is_refused_naming_key_and_value(sections, expected):
    assert expected in refusal(**sections)


def test_the_dry_build_never_touches_cuda(monkeypatch):
    import torch

    def no_cuda(*args, **kwargs):
        raise AssertionError("the launcher initialised CUDA")

    monkeypatch.setattr(torch.cuda, "init", no_cuda)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    assert preflight.check_factories(validate_run_config(BASE))  # built: a signature


def test_a_factory_that_reaches_for_cuda_is_left_to_the_ranks(monkeypatch):
    """`.cuda()` in a constructor: no dry build (None: no signature), and CUDA untouched."""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: calls.append("init"))
    data = copy.deepcopy(BASE)
    data["model"] = {"_target_": "tests.unit.test_preflight.CudaModel"}
    assert preflight.check_factories(validate_run_config(data)) is None
    assert calls == [] and torch.cuda._lazy_init is not None
    torch.cuda._lazy_init()  # the guard is gone again
    assert calls == ["init"]


class CudaModel(__import__("torch").nn.Linear):
    def __init__(self) -> None:
        super().__init__(64, 10)
        self.cuda()


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (
            {"model": {"_target_": "flodl.recipes.models.Nope"}},
            "model._target_=flodl.recipes.models.Nope: ",
        ),
        (
            {"task": {"train_step": "flodl.recipes.steps.nope_step"}},
            "task.train_step=flodl.recipes.steps.nope_step: module 'flodl.recipes.steps' "
            "has no attribute",
        ),
        (
            {
                "task": {
                    "metrics": {"f1": {"_target_": "torchmetrics.classification.F1"}},
                    "eval_metric": "f1",
                }
            },
            "task.metrics.f1._target_=torchmetrics.classification.F1: module",
        ),
    ],
)
def test_a_target_missing_from_its_module_is_named_with_its_key(section, expected):
    """Validation locates modules without importing them (it checks the attribute only of a
    module imported already); the launcher resolves every target, naming its key."""
    data = {**copy.deepcopy(BASE), **section}
    if "task" in section:
        data["task"] = {**BASE["task"], **section["task"]}
    with pytest.raises(ConfigError) as info:
        run_cfg = validate_run_config(data)
        preflight.check_factories(run_cfg)
        preflight.check_task_targets(run_cfg.task)
    assert expected in str(info.value) and "has no attribute" in str(info.value)


def test_topology_bound_knobs_are_checked(tmp_path):
    (tmp_path / "a_file").write_text("x")
    cases = {
        "trainer.callback_policy.rank=2: this run has 2 rank(s)": TrainerConfig(
            callback_policy={"kind": "rank", "rank": 2}
        ),
        f"trainer.save_path={tmp_path}/a_file/run: cannot write": TrainerConfig(
            save_path=f"{tmp_path}/a_file/run"
        ),
        f"trainer.resume_from={tmp_path}/none: no checkpoint": TrainerConfig(
            resume_from=f"{tmp_path}/none"
        ),
    }
    for expected, config in cases.items():
        with pytest.raises(
            ConfigError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")
        ):
            preflight.check_run(config, world_size=2)
    probe_dir = tmp_path / "fresh" / "dir"
    preflight.check_run(TrainerConfig(save_path=str(probe_dir / "run")), world_size=2)
    assert probe_dir.is_dir() and not list(probe_dir.iterdir())  # created, probe removed


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"save_path": ""}, "save_path=: empty"),
        ({"resume_from": " "}, "resume_from= : empty"),
        ({"cluster": {"controller": {"port": 65535}}}, "store listens on port+1"),
    ],
)
def test_schema_refuses_empty_stems_and_a_port_without_room_for_the_store(data, expected):
    from flodl.config import validate_trainer_config

    with pytest.raises(ConfigError, match=expected.replace("+", r"\+")):
        validate_trainer_config(data)


def test_objective_follows_task_settings():
    from flodl.cli.app import objective, objective_maximized
    from flodl.config import TaskConfig

    row = {"status": "ok", "eval_value": 0.9, "final_loss": 0.3, "metrics": {"f1": 0.7}}
    step = "flodl.recipes.steps.classification_step"
    with_eval = TaskConfig(train_step=step, eval_fn="flodl.recipes.steps.accuracy")
    assert objective(row, with_eval) == 0.9 and objective_maximized(with_eval)
    no_eval = {**row, "eval_value": None}
    assert objective(no_eval, TaskConfig(train_step=step)) == 0.3
    assert not objective_maximized(TaskConfig(train_step=step))
    loss = TaskConfig(train_step=step, eval_fn="flodl.recipes.steps.accuracy", objective="loss")
    assert objective(row, loss) == 0.3 and not objective_maximized(loss)
    nested = TaskConfig(train_step=step, objective="metrics.f1", objective_direction="maximize")
    assert objective(row, nested) == 0.7 and objective_maximized(nested)
    failed = objective({"status": "failed", "error": "x"}, with_eval)
    assert failed != failed  # NaN: an optimizing sweeper records a failed trial


def test_a_sweeper_direction_against_the_objective_is_warned(caplog):
    from omegaconf import OmegaConf

    from flodl.cli.sweep import _check_direction
    from flodl.config import TaskConfig

    task = TaskConfig(
        train_step="flodl.recipes.steps.classification_step", eval_fn="flodl.recipes.steps.accuracy"
    )
    for sweeper, warned in [
        ({"direction": "minimize"}, True),
        ({"direction": "maximize"}, False),
        ({"optim": {"maximize": False}}, True),
        ({"max_batch_size": None}, False),  # the basic sweeper does not optimize
    ]:
        caplog.clear()
        _check_direction(OmegaConf.create({"hydra": {"sweeper": sweeper}}), task)
        assert ("is better when larger" in caplog.text) is warned, sweeper


def test_the_dry_build_stays_cheap_no_dynamo_import():
    """torch.optim imports torch._dynamo on the first optimizer (seconds); the launcher's dry
    builds (targets, closures, the LR announcement's optimizer) avoid it, and a real optimizer
    built afterwards still gets it."""
    code = (
        "import sys, torch\n"
        "from flodl import preflight\n"
        "from flodl.config import validate_run_config\n"
        f"preflight.check_factories(validate_run_config({BASE!r}))\n"
        "assert 'torch._dynamo' not in sys.modules, 'dry build imported torch._dynamo'\n"
        "from flodl.config import TrainerConfig\n"
        "from flodl.runtime.wire.job_spec import JobSpec\n"
        "from flodl.placement.topology import resolve_topology\n"
        "spec = JobSpec(TrainerConfig(), lambda d: torch.nn.Linear(2, 2),\n"
        "    lambda p: torch.optim.Adam(p, lr=0.1), None, None,\n"
        "    scheduler_factory=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))\n"
        "assert preflight.launch_signature(spec, {})\n"
        "topology = resolve_topology(spec.config, probe_hosts=False)\n"
        "assert preflight.check_launch(spec, topology)['base_lr'] == 0.1\n"
        "assert 'torch._dynamo' not in sys.modules, 'launch checks imported torch._dynamo'\n"
        "torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)\n"
        "assert 'torch._dynamo' in sys.modules\n"
    )
    in_fresh_python(code, timeout=120)


def test_failed_jobs_are_counted_from_summaries_under_any_launcher(tmp_path, monkeypatch):
    """A launcher that runs jobs elsewhere (joblib, submitit) leaves only summary.json files:
    the callback counts this sweep's failed ones, so the command exits 1."""
    import json
    import os
    import time

    from omegaconf import OmegaConf

    from flodl.cli import app
    from flodl.cli.sweep import FailedJobs

    old = tmp_path / "0" / "summary.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"status": "failed"}))
    os.utime(old, (time.time() - 3600, time.time() - 3600))  # an earlier sweep, same directory
    callback = FailedJobs()
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    callback.on_multirun_start(config)
    for job, status in [("1", "ok"), ("2", "failed"), ("3", "interrupted")]:
        (tmp_path / job).mkdir()
        (tmp_path / job / "summary.json").write_text(json.dumps({"status": status}))
    with pytest.raises(app.JobsFailed) as failed:
        callback.on_multirun_end(config)
    assert failed.value.failed == 2 and failed.value.code == 1


def test_hydra_nodes_bind_as_hydra_passes_them():
    """`_args_` are positional arguments; `activation: {_target_: torch.nn.ReLU}` reaches the
    constructor built, not as a dict."""
    data = copy.deepcopy(BASE)
    data["model"] = {
        "_target_": "torch.nn.Sequential",
        "_args_": [{"_target_": "torch.nn.Linear", "in_features": 64, "out_features": 10}],
    }
    preflight.bind("model", validate_run_config(data).model, positional=0)
    data["model"] = {"_target_": "torch.nn.Linear", "_args_": [64, 10]}
    preflight.check_factories(validate_run_config(data))  # positional `_args_` count as bound
    targets._check_type("model", "act", {"_target_": "torch.nn.ReLU"}, typing.Callable, "x")


def in_fresh_python(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter (nothing imported yet); its stdout, once it passed."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _python_api_run(tmp_path, model_factory, optim_factory=None, **extra):
    from functools import partial

    import torch

    from flodl import ClusterConfig, LoggerConfig, Trainer
    from flodl.recipes.datasets import synthetic
    from flodl.recipes.steps import classification_step

    data = partial(synthetic, "train", n_train=64, n_test=16, input_shape=[1, 8, 8])
    builder = (
        Trainer.builder(
            model_factory,
            optim_factory or (lambda params: torch.optim.SGD(params, lr=0.1)),
            classification_step,
        )
        .dataset(data)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / "run")
    )
    for key, value in extra.items():
        builder = getattr(builder, key)(*value)
    return builder.run()


def test_python_api_closures_are_dry_built_before_any_rank(tmp_path):
    """A model factory that raises, an optimizer factory the model's parameters break, a
    scheduler factory with a bad value: each refused in the launcher, naming the closure and
    the innermost cause; no rank process starts (no rank log, no child process)."""
    import psutil
    import torch

    from flodl.recipes.models import MLP

    def good_model(device):
        return MLP([1, 8, 8], 10, hidden=16).to(device)

    def pretrained(device):
        try:
            raise FileNotFoundError("pretrained/backbone.pt: no such file")
        except FileNotFoundError as exc:
            raise RuntimeError("could not build") from exc

    def momentum(params):
        return torch.optim.SGD(params, lr=0.1, momentum=-1.0)

    def bad_step(optim):
        return torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda="x")

    cases = [
        (
            (pretrained, None, {}),
            "model_factory test_python_api_closures_are_dry_built_before_any_rank.<locals>."
            "pretrained refused on a dry build: FileNotFoundError: pretrained/backbone.pt",
        ),
        ((good_model, momentum, {}), "momentum refused on a dry build: ValueError: Invalid"),
        (
            (good_model, None, {"scheduler": (bad_step,)}),
            "scheduler_factory test_python_api_closures_are_dry_built_before_any_rank.<locals>."
            "bad_step refused on a dry build: TypeError",
        ),
    ]
    for (model, optim, extra), expected in cases:
        with pytest.raises(ConfigError) as info:
            _python_api_run(tmp_path, model, optim, **extra)
        assert expected in str(info.value), str(info.value)
        assert not list(tmp_path.glob("**/rank_*.log"))
        assert not [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid != fork_server.server_pid()
        ]


def test_python_api_signature_guards_resume():
    """The closures' dry build yields the architecture signature a resume bundle must match."""
    from flodl.preflight import launch
    from flodl.runtime.wire.job_spec import JobSpec

    def model(device):
        from flodl.recipes.models import MLP

        return MLP([1, 8, 8], 10, hidden=16).to(device)

    def wider(device):
        from flodl.recipes.models import MLP

        return MLP([1, 8, 8], 10, hidden=24).to(device)

    def spec(factory):
        import torch

        return JobSpec(
            config=TrainerConfig(),
            model_factory=factory,
            optim_factory=lambda p: torch.optim.SGD(p, lr=0.1),
            train_step=None,
            dataset=None,
        )

    first = launch.launch_signature(spec(model), {})
    assert first and first == launch.launch_signature(spec(model), {})
    assert first != launch.launch_signature(spec(wider), {})
    assert launch.launch_signature(spec(wider), {"model_signature": "hydra"}) == "hydra"


def test_a_metric_named_in_its_source_is_checked_without_importing_its_package(tmp_path):
    """torchmetrics (~1.3 s with scipy) is not on the launcher's path to the first step: the
    metric's module source binds the name, so it is imported by a background thread instead."""
    task = {
        "train_step": "flodl.recipes.steps.classification_step",
        "metrics": {
            "acc": {"_target_": "torchmetrics.classification.MulticlassAccuracy", "num_classes": 4}
        },
        "eval_metric": "acc",
    }
    code = (
        "import sys, threading\n"
        "from flodl.config import validate_run_config\n"
        "from flodl.preflight import check_task_targets\n"
        f"run_cfg = validate_run_config({ {**copy.deepcopy(BASE), 'task': task}!r})\n"
        "deferred = check_task_targets(run_cfg.task)\n"
        "print(deferred, 'torchmetrics.classification' in sys.modules)\n"
        "[t.join() for t in threading.enumerate() if t.name == 'flodl-metric-import']\n"
        "print('torchmetrics.classification' in sys.modules)\n"
    )
    assert in_fresh_python(code).split("\n")[:2] == [
        "['torchmetrics.classification.MulticlassAccuracy'] False",
        "True",
    ]


def test_what_a_modules_source_binds_is_found_and_what_it_does_not_is_not(tmp_path, monkeypatch):
    from flodl.config import defined_in_source

    pkg = tmp_path / "srcpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise RuntimeError('executed')\n"  # reading a module must never run it
        "from os.path import join as joined\n"
        "import json.decoder\n"
        "if True:\n    class InIf: ...\nelse:\n    def in_else(): ...\n"
        "try:\n    from .sub import from_sub\nexcept ImportError:\n    fallback = 1\n"
        "with open('x') as f:\n    in_with: int = 1\n"
        "from .sub import *\n"
    )
    (pkg / "sub.py").write_text("def from_sub(): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = ["joined", "json", "InIf", "in_else", "from_sub", "fallback", "in_with"]
    assert all(defined_in_source(f"srcpkg.{name}") for name in found)
    assert defined_in_source("srcpkg.sub.from_sub")
    # not bound by name (a star import, a typo, a missing module): the caller imports it
    for path in ("srcpkg.star_only", "srcpkg.Inif", "srcpkg.nosuch.X", "nosuchpkg.X", "Bare"):
        assert not defined_in_source(path), path
    assert "srcpkg" not in sys.modules
