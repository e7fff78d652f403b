"""Config holes of issue 41 (item 6): every timeout knob is bounded and finite, a NaN says "must
be finite", checkpoint_every needs save_path, a bad dataset size is blamed on its own key. All
refused at validation (exit code 2), before any rank."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from flodl import preflight
from flodl.config import ConfigError, TrainerConfig, validate_run_config

BASE = {
    "model": {"_target_": "flodl.recipes.models.MLP", "input_shape": [1, 8, 8], "num_classes": 10},
    "optimizer": {"_target_": "torch.optim.Adam", "lr": 1e-3},
    "dataset": {"_target_": "flodl.recipes.datasets.digits"},
    "task": {"train_step": "flodl.recipes.steps.classification_step"},
}
NAN, INF = float("nan"), float("inf")


def refusal(check_factories: bool = False, **sections) -> ConfigError:
    data = copy.deepcopy(BASE)
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values} if section != "dataset" else values
    with pytest.raises(ConfigError) as info:
        cfg = validate_run_config(data)
        if check_factories:
            preflight.check_factories(cfg)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [
        ({"start_timeout_s": INF}, "cluster.start_timeout_s=inf: must be finite"),
        ({"start_timeout_s": 1e-6}, "cluster.start_timeout_s=1e-06: Input should be greater"),
        ({"start_timeout_s": 1e9}, "cluster.start_timeout_s=1000000000.0: Input should be less"),
        ({"heartbeat_timeout_s": 1e-9}, "cluster.heartbeat_timeout_s=1e-09: Input should be"),
        ({"heartbeat_timeout_s": INF}, "cluster.heartbeat_timeout_s=inf: must be finite"),
        ({"heartbeat_timeout_s": NAN}, "cluster.heartbeat_timeout_s=nan: must be finite"),
    ],
)
def test_timeouts_are_bounded_and_finite(cluster, expected):
    """Was: inf crashed every rank (OverflowError), 1e-9 flooded the log, 1e-6 was accepted,
    heartbeat inf silently disabled freeze detection."""
    assert str(refusal(cluster=cluster)).startswith(expected)


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("elche", "gamma"),
        ("elche", "overhead_target"),
        ("trainer", "max_grad_norm"),
        ("trainer", "lr_scale_ratio"),
    ],
)
@pytest.mark.parametrize("value", [NAN, INF])
def test_nan_and_inf_say_must_be_finite(section, key, value):
    """Was: elche.gamma=nan reported as "should be <= 4"."""
    message = str(refusal(**{section: {key: value}}))
    assert message == f"{section}.{key}={value}: must be finite (a number, not NaN or inf)"


def test_bounds_are_stated_in_the_descriptions():
    fields = TrainerConfig.model_fields["cluster"].default_factory().model_fields  # type: ignore[misc]
    assert "[1, 86400]" in fields["start_timeout_s"].description
    assert "[0.1, 3600]" in fields["heartbeat_timeout_s"].description


def test_checkpoint_every_without_save_path_is_refused():
    """Was: silently ignored (no checkpoint was ever written)."""
    message = str(refusal(trainer={"checkpoint_every": 2}))
    assert message.startswith("trainer.checkpoint_every=2 needs trainer.save_path")
    assert "trainer.checkpoint_every=null" in message
    with pytest.raises(ValueError, match=r"checkpoint_every=1 needs trainer\.save_path"):
        TrainerConfig(checkpoint_every=1)
    assert TrainerConfig(checkpoint_every=1, save_path="/tmp/x").checkpoint_every == 1


def test_a_negative_dataset_size_is_blamed_on_its_own_key():
    """Was: dataset.n_train=-5 blamed on trainer.batch_size."""
    synthetic = {"_target_": "flodl.recipes.datasets.synthetic", "input_shape": [1, 8, 8]}
    message = str(refusal(True, dataset={**synthetic, "n_train": -5}))
    assert message == "dataset.n_train=-5: must be >= 1 (samples to generate)"
    assert "batch_size" not in message
    message = str(
        refusal(True, dataset={"_target_": "flodl.recipes.datasets.digits", "test_size": 5000})
    )
    assert message.startswith("dataset.test_size=5000: must be in [1, 1796]")


def test_the_cli_exits_2_with_one_line(tmp_path):
    """Through flodl's own entry: exit 2, one line, no traceback, no rank started."""
    proc = subprocess.run(
        [sys.executable, "run.py", "cluster.start_timeout_s=inf", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cluster.start_timeout_s=inf: must be finite" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
