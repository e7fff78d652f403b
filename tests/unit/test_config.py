"""The config surface: pinned on purpose, validated once, errors that name key, value and fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flodl.config import (
    ClusterConfig,
    ConfigError,
    ElCheConfig,
    LoggerConfig,
    Mode,
    SchedulerConfig,
    TaskConfig,
    TrainerConfig,
    TrainerKnobs,
    validate_run_config,
    validate_trainer_config,
)

# Changing the public surface must be a deliberate act: update this list and the README.
SURFACE = {
    "TrainerKnobs": [
        "accumulate_grad_batches",
        "batch_size",
        "callback_policy",
        "checkpoint_every",
        "compile",
        "device",
        "early_stopping",
        "eval_every",
        "eval_policy",
        "lr_scale_ratio",
        "max_failure",
        "max_grad_norm",
        "max_nonfinite",
        "num_epochs",
        "on_rank_error",
        "precision",
        "resume_fallback",
        "resume_from",
        "save_best",
        "save_path",
        "seed",
    ],
    "ElCheConfig": [
        "anchor",
        "compress",
        "divergence_threshold",
        "easgd_alpha",
        "gamma",
        "guard",
        "max_anchor",
        "max_batch_diff",
        "max_overshoot",
        "meta_controller",
        "min_anchor",
        "mode",
        "outer",
        "outer_lr",
        "outer_momentum",
        "overhead_target",
        "partition_ratios",
        "relax_up",
    ],
    "ClusterConfig": [
        "batch_sizes",
        "controller",
        "heartbeat_timeout_s",
        "kind",
        "link",
        "memory_fraction",
        "memory_mb",
        "memory_plan",
        "pace_margin",
        "ranks",
        "shared_memory",
        "slurm",
        "speeds",
        "start_timeout_s",
        "threads_per_rank",
        "warmup_steps",
        "workers",
    ],
    "LoggerConfig": [
        "csv",
        "host",
        "keep_serving",
        "level",
        "log_every_n_steps",
        "mlflow",
        "progress",
        "serve",
        "tensorboard",
        "wandb",
    ],
    "TaskConfig": [
        "epoch_fn",
        "eval_fn",
        "eval_higher_is_better",
        "eval_loss",
        "eval_metric",
        "eval_result_fn",
        "eval_step",
        "metrics",
        "metrics_fn",
        "objective",
        "objective_direction",
        "train_step",
    ],
    "SchedulerConfig": ["interval", "target"],
}


@pytest.mark.parametrize(
    "model",
    [TrainerKnobs, ElCheConfig, ClusterConfig, LoggerConfig, TaskConfig, SchedulerConfig],
    ids=lambda m: m.__name__,
)
def test_config_surface_is_pinned(model):
    assert sorted(model.model_fields) == SURFACE[model.__name__]


def test_every_field_has_a_description():
    for model in (TrainerKnobs, ElCheConfig, ClusterConfig, LoggerConfig):
        for name, field in model.model_fields.items():
            if name != "callback_policy":
                assert field.description, f"{model.__name__}.{name} has no doc string"


def test_defaults_follow_the_original():
    e = ElCheConfig()
    assert e.mode is Mode.NCCL_CADENCE
    assert (e.anchor, e.max_anchor, e.overhead_target) == (10, 1000, 0.05)
    assert e.max_batch_diff is None and e.relax_up is False and e.meta_controller is True
    assert e.effective_divergence_threshold == 0.05
    assert e.effective_min_anchor == 10


def test_presets():
    assert ElCheConfig.nccl_sync().anchor == 1
    assert ElCheConfig.cpu_sync().mode is Mode.CPU_SYNC
    assert ElCheConfig.cpu_async().effective_easgd_alpha == 0.5
    assert ElCheConfig.cpu_async().effective_divergence_threshold == 0.3
    # cpu_async windows like the cadence modes (its averaging is overlapped: at anchor 1 no
    # overhead is ever measured to grow it, and it averaged every slow-rank batch)
    assert ElCheConfig.cpu_async().anchor == ElCheConfig.nccl_cadence().anchor == 10
    assert ElCheConfig.cpu_async().effective_min_anchor == 10
    assert ElCheConfig.nccl_cadence().effective_easgd_alpha is None
    assert ElCheConfig.nccl_cadence(max_anchor=50).max_anchor == 50


def _run_data(**section):
    data = {
        "model": {
            "_target_": "flodl.recipes.models.MLP",
            "input_shape": [1, 8, 8],
            "num_classes": 10,
        },
        "optimizer": {"_target_": "torch.optim.Adam", "lr": 0.001},
        "dataset": {"_target_": "flodl.recipes.datasets.digits"},
        "task": {"train_step": "flodl.recipes.steps.classification_step"},
    }
    for key, value in section.items():
        data[key] = value
    return data


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"elche": {"mode": "fast"}}, "elche.mode=fast: Input should be"),
        ({"trainer": {"batch_size": 0}}, "trainer.batch_size=0: Input should be greater than"),
        (
            {"cluster": {"kind": "cpu_rig", "speeds": [1, -1]}},
            "cluster.speeds=[1, -1]: every speed",
        ),
        ({"trainer": {"nmu_epochs": 3}}, "trainer.nmu_epochs: unknown key"),
        ({"elche": {"overhead_target": 2.0}}, "elche.overhead_target=2.0: Input should be less"),
        ({"cluster": {"ranks": 3, "speeds": [1.0, 0.5]}}, "speeds has 2 entries but ranks=3"),
        ({"elche": {"anchor": 5, "min_anchor": 50, "max_anchor": 20}}, "exceeds max_anchor"),
        (
            {"trainer": {"save_best": {"monitor": "eval_loss"}}},
            "save_best needs trainer.save_path",
        ),
        (
            {
                "task": {
                    "train_step": "flodl.recipes.steps.classification_step",
                    "eval_loss": "torch.nn.functional.cross_entropy",
                    "eval_metric": "eval_loss",
                },
                "trainer": {"early_stopping": {"monitor": "f1", "mode": "max"}},
            },
            "trainer.early_stopping.monitor=f1: not a metric of this task; one of train_loss, "
            "eval_loss",
        ),
        (
            {
                "task": {
                    "train_step": "flodl.recipes.steps.classification_step",
                    "metrics": {
                        "acc": {"_target_": "torchmetrics.classification.MulticlassAccuracy"}
                    },
                    "eval_metric": "accuracy",
                }
            },
            "task.eval_metric=accuracy: not one of the eval metrics (acc)",
        ),
        ({"trainer": {"eval_policy": "all"}}, "trainer.eval_policy=all: Input should be"),
    ],
)
def test_bad_values_name_key_value_and_rule(section, expected):
    with pytest.raises(ConfigError) as info:
        validate_run_config(_run_data(**section))
    assert expected in str(info.value)
    assert "\n" not in str(info.value)
    assert info.value.exit_code == 2


def test_unimportable_target_is_refused():
    data = _run_data(model={"_target_": "flodl.recipes.nope.Model"})
    refused = r"model\._target_.*cannot import module 'flodl.recipes.nope'"
    with pytest.raises(ConfigError, match=refused):
        validate_run_config(data)
    data = _run_data(model={"_target_": "flodl.config.Nope"})  # imported already: checked
    with pytest.raises(ConfigError, match=r"model\._target_.*no attribute 'Nope'"):
        validate_run_config(data)


def test_validation_imports_no_target():
    """Targets are located on disk, not imported: a pure-config refusal never pays for torch."""
    import subprocess
    import sys

    metric = {"_target_": "torchmetrics.classification.MulticlassAccuracy", "num_classes": 10}
    task = {
        "train_step": "flodl.recipes.steps.classification_step",
        "eval_loss": "torch.nn.functional.cross_entropy",
        "metrics": {"accuracy": metric},
    }
    code = (
        "import sys\n"
        "from flodl.config import validate_run_config\n"
        f"validate_run_config({_run_data(task=task)!r})\n"
        "names = ('torch', 'torchmetrics', 'flodl.recipes.models')\n"
        "print(sorted(m for m in names if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_missing_section_is_named():
    data = _run_data()
    del data["task"]
    with pytest.raises(ConfigError, match="task: required key is missing"):
        validate_run_config(data)


def test_run_config_folds_sections_into_trainer_config():
    run = validate_run_config(_run_data(elche={"mode": "cpu_async"}, trainer={"num_epochs": 4}))
    cfg = run.trainer_config()
    assert isinstance(cfg, TrainerConfig)
    assert cfg.num_epochs == 4 and cfg.elche.mode is Mode.CPU_ASYNC
    assert run.digest() == validate_run_config(run.model_dump(by_alias=True)).digest()


def test_trainer_config_is_frozen_and_with_revalidates():
    cfg = TrainerConfig()
    with pytest.raises(ValidationError):
        cfg.batch_size = 3  # type: ignore[misc]
    with pytest.raises(ValidationError):
        cfg.with_(batch_size=-1)
    assert cfg.with_(batch_size=7).batch_size == 7


def test_validate_trainer_config_prefixes_keys():
    with pytest.raises(ConfigError, match=r"^trainer\.num_epochs=0"):
        validate_trainer_config({"num_epochs": 0})
