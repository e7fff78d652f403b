"""The Python API builder reaches the knobs the CLI does; unknown keywords read like the CLI's."""

from __future__ import annotations

from functools import partial

import pytest

from flodl import ClusterConfig, ConfigError, LoggerConfig, Trainer, TrainerConfig
from flodl.config import ElCheConfig, MonitorConfig, validate_run_config
from flodl.recipes.steps import accuracy, classification_step


def builder():
    return Trainer.builder(lambda device: None, lambda params: None, lambda m, b: None)


def test_checkpoint_and_scaling_knobs_set_their_trainer_config_fields(tmp_path):
    cfg = (
        builder()
        .save_path(tmp_path / "ckpt" / "run")
        .checkpoint_every(2)
        .resume_from(tmp_path / "old", fallback=True)
        .save_best("accuracy", mode="max")
        .lr_scale_ratio(0.5)
        .eval_every(3)
        .max_failure("50%")
        .max_nonfinite(4)
        .device("cpu")
        .build_config()
    )
    assert cfg.save_path == str(tmp_path / "ckpt" / "run")
    assert cfg.checkpoint_every == 2
    assert cfg.resume_from == str(tmp_path / "old") and cfg.resume_fallback is True
    assert cfg.save_best == MonitorConfig(monitor="accuracy", mode="max")
    assert cfg.lr_scale_ratio == 0.5 and cfg.eval_every == 3
    assert cfg.max_failure == "50%" and cfg.max_nonfinite == 4 and cfg.device == "cpu"


def test_the_builder_methods_win_over_a_config_bag_given_later():
    bag = TrainerConfig(save_path="bag/run", checkpoint_every=1)
    cfg = builder().save_path("ckpt/run").checkpoint_every(5).config(bag).build_config()
    assert (cfg.save_path, cfg.checkpoint_every) == ("ckpt/run", 5)


def test_a_bad_builder_value_names_the_key_and_the_rule(tmp_path):
    with pytest.raises(ConfigError, match=r"^trainer\.checkpoint_every=0: .*greater than"):
        builder().checkpoint_every(0).build_config()
    with pytest.raises(ConfigError, match=r"save_best needs trainer\.save_path"):
        builder().save_best(MonitorConfig()).build_config()
    with pytest.raises(ConfigError, match=r"trainer\.lr_scale_ratio=2"):
        builder().lr_scale_ratio(2).build_config()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: TrainerConfig(chekpoint_every=1),
            "TrainerConfig(chekpoint_every=...): unknown key (did you mean checkpoint_every?)",
        ),
        (
            lambda: ClusterConfig(rnaks=2),
            "ClusterConfig(rnaks=...): unknown key (did you mean ranks?)",
        ),
        (lambda: LoggerConfig(zzz=1), "LoggerConfig(zzz=...): unknown key; allowed: csv, "),
        (
            lambda: ElCheConfig.nccl_sync(ancor=3),
            "ElCheConfig(ancor=...): unknown key (did you mean anchor",
        ),
    ],
)
def test_unknown_keywords_are_one_config_error_with_the_likely_key(make, expected):
    with pytest.raises(ConfigError) as info:
        make()
    message = str(info.value)
    assert message.startswith(expected), message
    assert "\n" not in message and info.value.exit_code == 2


def test_a_misspelt_key_in_a_config_file_gets_the_same_suggestion_with_its_path():
    base = {
        "model": {"_target_": "flodl.recipes.models.MLP"},
        "optimizer": {"_target_": "torch.optim.Adam"},
        "dataset": {"_target_": "flodl.recipes.datasets.synthetic"},
        "task": {"train_step": "flodl.recipes.steps.classification_step"},
    }
    cases = {
        "trainer": ({"chekpoint_every": 1}, "trainer.chekpoint_every: unknown key (did you mean "),
        "cluster": ({"rnaks": 2}, "cluster.rnaks: unknown key (did you mean cluster.ranks?)"),
    }
    for section, (value, expected) in cases.items():
        with pytest.raises(ConfigError) as info:
            validate_run_config({**base, section: value})
        assert str(info.value).startswith(expected), str(info.value)
    with pytest.raises(ConfigError, match=r"^cluster\.controller\.prot: unknown key \(did you"):
        validate_run_config({**base, "cluster": {"controller": {"prot": 1}}})


@pytest.mark.slow
def test_save_path_checkpoint_every_and_resume_from_through_the_builder(tmp_path):
    """One rank: save every epoch through the builder, then resume from that bundle."""
    from tests.integration.helpers import data, model_factory, optim_factory

    def run(epochs: int, **knobs):
        b = (
            Trainer.builder(model_factory, optim_factory, classification_step)
            .dataset(partial(data, "train", 256))
            .eval_dataset(partial(data, "test"))
            .eval_fn(accuracy)
            .batch_size(32)
            .num_epochs(epochs)
            .elche(ElCheConfig.solo())
            .cluster(ClusterConfig(kind="cpu_rig", ranks=1, speeds=[1.0], warmup_steps=2))
            .logger(LoggerConfig(progress="off", tensorboard=False))
            .output_dir(tmp_path / f"run{epochs}")
        )
        for name, value in knobs.items():
            b = getattr(b, name)(value)
        handle = b.run()
        handle.join(timeout=240)
        return handle

    stem = tmp_path / "ckpt" / "run"
    first = run(1, save_path=stem, checkpoint_every=1)
    assert first.summary is not None and first.summary.status == "ok"
    assert list(stem.parent.glob("run*.meta.json")), list(stem.parent.iterdir())
    resumed = run(2, resume_from=stem)
    assert [m.epoch for m in resumed.result.epochs] == [2]  # the first epoch came from the bundle


CONSOLE = """
import logging, sys
from flodl.trainer import console_logging
if sys.argv[1] == "root":
    logging.basicConfig(format="ROOT %(message)s", level=logging.INFO)
console_logging(sys.argv[2])
console_logging(sys.argv[2])  # a second run adds no second handler
logging.getLogger("flodl.job").info("flodl: lr 0.1 x 2.0")
logging.getLogger("flodl.job").warning("a warning")
"""


@pytest.mark.light
@pytest.mark.parametrize(
    ("setup", "level", "expected"),
    [
        ("none", "INFO", ["flodl: lr 0.1 x 2.0", "a warning"]),
        ("none", "WARNING", ["a warning"]),  # the way to silence the INFO lines
        ("root", "INFO", ["ROOT flodl: lr 0.1 x 2.0", "ROOT a warning"]),  # theirs, once
    ],
)
def test_the_python_api_prints_flodls_lines_without_any_logging_set_up(setup, level, expected):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", CONSOLE, setup, level],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stderr.splitlines() == expected
