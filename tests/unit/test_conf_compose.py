"""Every file in conf/ composes and validates; the default job is what the README says."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import pytest
from hydra import compose, initialize_config_dir
from pydantic import BaseModel

from flodl.cli.app import plain_config
from flodl.config import SCHEMA_GROUPS, Mode, RunConfig, validate_run_config

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = [
    "model",
    "optimizer",
    "dataset",
    "task",
    "elche",
    "cluster",
    "logger",
    "experiment",
    "scheduler",
    "workload",
    "trainer",
]


def _compose(overrides: list[str], hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


def _options() -> list[tuple[str, str]]:
    return [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def test_every_group_has_options():
    for group in GROUPS:
        assert list((CONF / group).glob("*.yaml")), f"conf/{group}/ is empty"


def _needs(group: str, option: str) -> list[str]:
    """What an option needs beside it to compose into a valid run (its data, its model)."""
    overrides = []
    if group == "model" and option == "resnet":
        overrides += ["dataset=synthetic", "dataset.input_shape=[3,32,32]"]
    if (group, option) in {("dataset", "shakespeare"), ("task", "language_model")}:
        overrides += ["model=char_rnn"]  # text data has no input_shape for the default MLP
    if (group, option) in {
        ("dataset", "hf"),
        ("task", "causal_lm"),
        ("task", "seq_classification"),
    }:
        overrides += ["model=hf"]  # Hugging Face text: the MLP has nothing to read
    return overrides


@pytest.mark.parametrize(("group", "option"), _options(), ids=lambda x: str(x))
def test_option_composes_and_validates(group, option):
    cfg = _compose([f"{group}={option}", *_needs(group, option)])
    run = validate_run_config(plain_config(cfg))
    if group == "elche":
        assert run.elche.mode is Mode(option)
    if group == "model" and option == "conv_ae":
        assert run.task.train_step.endswith("reconstruction_step")
    if group == "experiment" and option == "ddp_bench":
        assert run.cluster.speeds == [1.0, 0.4] and run.trainer.lr_scale_ratio == 0.0
    if group == "experiment" and option == "hf_lora":
        assert run.model.target == "flodl.hf.models.auto_model"
        assert run.model.kwargs()["peft"]["r"] == 4 and run.model.kwargs()["dtype"] == "bfloat16"
        assert run.task.train_step == "flodl.hf.steps.causal_lm_step"
        assert run.cluster.ranks == 2 and run.trainer.checkpoint_every == 1
    if group == "model" and option == "hf":
        assert run.dataset.target == "flodl.hf.data.text_dataset"
        assert run.model.kwargs()["config"]["vocab_size"] == 512  # the tokenizer it trains
    if group == "model" and option in {"char_rnn", "gpt_nano"}:
        assert run.task.train_step.endswith("language_model_step")
        assert run.dataset.target == "flodl.recipes.text.shakespeare"


def test_ddp_bench_sweeps_the_seven_workloads_and_every_mode():
    cfg = _compose(["experiment=ddp_bench"], hydra=True)
    params = cfg.hydra.sweeper.params
    assert params.workload.split(",") == [p.stem for p in _bench_order()]
    assert set(params.elche.split(",")) == {m.value for m in Mode}


def _bench_order() -> list[Path]:
    names = ["logistic", "mlp", "lenet", "conv_ae", "resnet", "char_rnn", "gpt_nano"]
    paths = [CONF / "workload" / f"{n}.yaml" for n in names]
    assert sorted(paths) == sorted((CONF / "workload").glob("*.yaml"))
    return paths


def test_default_job_matches_the_readme():
    cfg = _compose([], hydra=True)
    assert cfg.hydra.mode.name == "MULTIRUN"
    run = validate_run_config(plain_config(cfg))
    assert run.model.target == "flodl.recipes.models.MLP"
    assert run.dataset.target == "flodl.recipes.datasets.mnist5k"
    assert run.elche.mode is Mode.NCCL_CADENCE
    assert run.cluster.kind == "cpu_rig" and run.cluster.speeds == [1.0, 0.5]


def test_launcher_plugin_is_selected_and_discoverable():
    cfg = _compose([], hydra=True)
    assert cfg.hydra.launcher._target_ == "hydra_plugins.flodl_launcher.launcher.FlodlLauncher"


def test_plugin_import_is_light():
    import subprocess
    import sys

    code = (
        "import sys, hydra_plugins.flodl_launcher.launcher;"
        "print('torch' in sys.modules, 'flodl.runtime.rank.loop' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=CONF.parent,
    )
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("cluster", [p.stem for p in sorted((CONF / "cluster").glob("*.yaml"))])
def test_cluster_settings_the_readme_lists_override_without_plus(cluster):
    """`cluster.heartbeat_timeout_s=5` works as written (no `+`) with every cluster option."""
    cfg = _compose([f"cluster={cluster}", "cluster.heartbeat_timeout_s=5"])
    assert validate_run_config(plain_config(cfg)).cluster.heartbeat_timeout_s == 5


@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
def test_elche_presets_have_one_source(mode):
    """conf/elche/<mode>.yaml states only what ELCHE_PRESETS changes from the schema, and it
    composes to exactly ElCheConfig.<mode>() (every key, overridable without ``+``)."""
    import yaml

    from flodl.config import ELCHE_PRESETS, ElCheConfig, preset_yaml_keys

    stated = yaml.safe_load((CONF / "elche" / f"{mode.value}.yaml").read_text())
    assert stated.pop("defaults") == ["_schema", "_self_"]
    assert stated == preset_yaml_keys(mode)
    run = validate_run_config(plain_config(_compose([f"elche={mode.value}", "elche.gamma=2.0"])))
    assert run.elche == ElCheConfig.preset(mode, gamma=2.0)
    assert set(ELCHE_PRESETS) == set(Mode)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The schema model a field holds (``X`` or ``X | None``); None for lists, dicts, values."""
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    for option in (annotation, *options):
        if isinstance(option, type) and issubclass(option, BaseModel):
            return option
    return None


#: Groups a run may leave out (``scheduler: null`` in the defaults): no section, no keys.
OPTIONAL_SECTIONS = ("scheduler",)


def _absent_keys(model: type[BaseModel], data: Mapping[str, Any], prefix: str) -> list[str]:
    """Every schema key of ``model`` (nested sections too) that the composed ``data`` lacks."""
    absent = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in data:
            if not prefix and key in OPTIONAL_SECTIONS:
                continue
            absent.append(f"{prefix}{key}")
            continue
        inner = _section_model(field.annotation)
        if inner is not None and isinstance(data[key], Mapping):
            absent += _absent_keys(inner, data[key], f"{prefix}{key}.")
    return absent


@pytest.mark.parametrize(("group", "option"), _options(), ids=lambda x: str(x))
def test_every_schema_key_is_in_every_option(group, option):
    """Whatever option a run picks, every key of the schema is in the composed config, so each
    is settable from the command line and a project's config without ``+``."""
    composed = plain_config(_compose([f"{group}={option}", *_needs(group, option)]))
    assert _absent_keys(RunConfig, composed, "") == []


def test_the_key_check_sees_a_missing_nested_key():
    composed = plain_config(_compose([]))
    del composed["cluster"]["link"]["latency_ms"], composed["trainer"]["seed"]
    assert _absent_keys(RunConfig, composed, "") == ["trainer.seed", "cluster.link.latency_ms"]


@pytest.mark.parametrize("group", sorted(SCHEMA_GROUPS))
def test_schema_groups_state_only_what_they_change(group):
    """Each option of a group composed from the schema extends ``_schema`` first (its own keys
    after), so the schema, not a hand-copied list, says which keys exist."""
    import yaml

    options = sorted((CONF / group).glob("*.yaml"))
    for path in options:  # _schema first, or another option of the group that lists it
        stated = yaml.safe_load(path.read_text()) or {}
        assert stated.get("defaults", [None])[0] in ["_schema", *(p.stem for p in options)], path


@pytest.mark.parametrize("cluster", ["auto", "cpu_rig", "slurm", "example_hosts"])
def test_nested_and_memory_keys_override_in_every_cluster_option(cluster):
    overrides = [
        f"cluster={cluster}",
        "cluster.memory_plan=none",
        "cluster.shared_memory=false",
        "cluster.link.profile=1gbe",
        "cluster.link.bandwidth_gbps=0.1",
        "cluster.link.latency_ms=2",
    ]
    run = validate_run_config(plain_config(_compose(overrides)))
    assert (run.cluster.memory_plan, run.cluster.shared_memory) == ("none", False)
    link = run.cluster.link
    assert (link.profile, link.bandwidth_gbps, link.latency_ms) == ("1gbe", 0.1, 2.0)


def test_the_rig_takes_memory_mb_and_both_link_forms():
    def cluster(*overrides: str):
        return validate_run_config(plain_config(_compose(["cluster=cpu_rig", *overrides]))).cluster

    assert cluster("cluster.memory_mb=[300,200]").memory_mb == [300, 200]
    assert cluster("cluster.link=1gbe").link.profile == "1gbe"
    whole = cluster("cluster.link={profile: 10gbe, bandwidth_gbps: 0.1}").link
    assert (whole.profile, whole.bandwidth_gbps, whole.latency_ms) == ("10gbe", 0.1, None)
