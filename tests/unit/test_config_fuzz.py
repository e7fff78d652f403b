"""Hypothesis: any bad value or unknown key is a ConfigError (exit 2) that names the key."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.cli.app import check_override_keys
from flodl.config import ConfigError, validate_run_config

BASE = {
    "model": {"_target_": "flodl.recipes.models.MLP", "input_shape": [1, 8, 8], "num_classes": 10},
    "optimizer": {"_target_": "torch.optim.Adam", "lr": 0.001},
    "dataset": {"_target_": "flodl.recipes.datasets.digits"},
    "task": {"train_step": "flodl.recipes.steps.classification_step"},
}

# (section, key, strategy of values that must be refused)
BAD = [
    ("trainer", "batch_size", st.integers(max_value=0)),
    ("trainer", "num_epochs", st.integers(max_value=0)),
    ("trainer", "seed", st.integers(max_value=-1)),
    ("trainer", "max_grad_norm", st.floats(max_value=0.0)),
    ("trainer", "lr_scale_ratio", st.floats(min_value=1.0001, allow_infinity=False)),
    ("trainer", "eval_every", st.integers(max_value=0)),
    ("trainer", "checkpoint_every", st.integers(max_value=0)),
    ("trainer", "max_failure", st.text(string.ascii_letters, min_size=1)),
    (
        "trainer",
        "device",
        st.text(string.ascii_letters, min_size=1).filter(
            lambda s: s not in {"auto", "cpu", "cuda"}
        ),
    ),
    (
        "elche",
        "mode",
        st.text(min_size=1).filter(
            lambda s: (
                s
                not in {"nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async", "solo"}
            )
        ),
    ),
    ("elche", "anchor", st.integers(max_value=0)),
    ("elche", "overhead_target", st.floats(min_value=0.5001, allow_infinity=False)),
    ("elche", "overhead_target", st.floats(max_value=0.0099)),
    ("elche", "gamma", st.floats(min_value=4.0001, allow_infinity=False)),
    ("elche", "easgd_alpha", st.floats(min_value=1.0001, allow_infinity=False)),
    ("elche", "guard", st.text(min_size=1).filter(lambda s: s not in {"trend", "msf", "none"})),
    ("cluster", "ranks", st.integers(max_value=0)),
    ("cluster", "kind", st.text(min_size=1).filter(lambda s: s not in {"auto", "cpu_rig"})),
    ("cluster", "speeds", st.lists(st.floats(max_value=0.0), min_size=2, max_size=2)),
    ("cluster", "heartbeat_timeout_s", st.floats(max_value=0.0)),
    ("logger", "serve", st.integers(min_value=65536)),
    (
        "logger",
        "level",
        st.text(min_size=1).filter(lambda s: s not in {"DEBUG", "INFO", "WARNING", "ERROR"}),
    ),
]


@pytest.mark.parametrize(("section", "key", "values"), BAD, ids=lambda x: str(x)[:30])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_bad_values_name_the_key(section, key, values, data):
    value = data.draw(values)
    cfg = {**BASE, section: {key: value}}
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg)
    assert str(info.value).startswith(f"{section}.{key}")
    assert info.value.exit_code == 2


@settings(max_examples=200, deadline=None)
@given(
    section=st.sampled_from(["trainer", "elche", "cluster", "logger", "task"]),
    key=st.text(string.ascii_lowercase + "_", min_size=1, max_size=20),
)
def test_unknown_keys_are_refused_on_the_command_line_and_in_the_schema(section, key):
    from flodl.cli.app import _SECTIONS

    if key in _SECTIONS[section].model_fields:
        return
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}: unknown key"):
        check_override_keys([f"{section}.{key}=1"])
    with pytest.raises(ConfigError, match=rf"{section}\.{key}: unknown key"):
        validate_run_config(
            {**BASE, section: {key: 1}}
            if section != "task"
            else {**BASE, "task": {**BASE["task"], key: 1}}
        )
