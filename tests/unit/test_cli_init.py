"""``flodl init``: writes examples/own_project (kept identical), renames its package, overwrites
nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl.__main__ import main
from flodl.cli.init import render

pytestmark = pytest.mark.light

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_project"


def test_the_template_is_the_example_project_file_for_file():
    files = render("myproj")
    example = {
        str(p.relative_to(EXAMPLE)): p.read_text(encoding="utf-8")
        for p in EXAMPLE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert files == example  # edit both: examples/own_project and flodl/cli/project_template


def test_init_writes_a_project_under_its_package_name(tmp_path, capsys):
    assert main(["init", str(tmp_path / "lab"), "--package", "labnet"]) == 0
    config = (tmp_path / "lab" / "conf" / "config.yaml").read_text()
    assert "_target_: labnet.models.TinyNet" in config and "myproj" not in config
    assert (tmp_path / "lab" / "labnet" / "steps.py").exists()
    assert "from labnet.models import TinyNet" in (tmp_path / "lab" / "train_api.py").read_text()
    assert "next: cd" in capsys.readouterr().out


def test_init_overwrites_nothing_and_refuses_a_bad_name(tmp_path, capsys):
    assert main(["init", str(tmp_path)]) == 0
    before = (tmp_path / "conf" / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["init", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "conf/config.yaml: already exists" in err
    assert (tmp_path / "conf" / "config.yaml").read_text() == before
    assert main(["init", str(tmp_path / "x"), "--package=my-proj"]) == 2
    assert "--package=my-proj: not a Python package name" in capsys.readouterr().err
