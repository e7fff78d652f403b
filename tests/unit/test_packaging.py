"""The wheel's package list (pyproject.toml) covers every folder that holds flodl's code or config:
the design card's top level (``conf/`` and ``recipes/`` beside ``flodl/``) is mapped into the
package, so the list is explicit and a new folder must be added to it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)["tool"]["setuptools"]


def _folders(top: Path, package: str) -> set[str]:
    """``package`` and a dotted name for each folder under ``top`` (caches aside)."""
    names = {package}
    for folder in top.rglob("*"):
        if folder.is_dir() and "__pycache__" not in folder.parts:
            names.add(".".join([package, *folder.relative_to(top).parts]))
    return names


def test_every_folder_is_a_listed_package() -> None:
    mapped = _setuptools()["package-dir"]
    expected = _folders(ROOT / "flodl", "flodl") | _folders(ROOT / "hydra_plugins", "hydra_plugins")
    for package, folder in mapped.items():
        expected |= _folders(ROOT / folder, package)
    assert set(_setuptools()["packages"]) == expected


def test_conf_and_recipes_sit_at_the_top_and_ship_as_flodls_own() -> None:
    assert _setuptools()["package-dir"] == {"flodl.conf": "conf", "flodl.recipes": "recipes"}
    assert not (ROOT / "flodl" / "conf").exists() and not (ROOT / "flodl" / "recipes").exists()
    conf = importlib.util.find_spec("flodl.conf")
    recipes = importlib.util.find_spec("flodl.recipes.models")
    assert conf is not None and recipes is not None
    assert Path(str(conf.origin)).parent.name == "conf"
    assert (Path(str(conf.origin)).parent / "elche" / "nccl_cadence.yaml").is_file()
    assert Path(str(recipes.origin)).parent.name == "recipes"
