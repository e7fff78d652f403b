"""The built site renders: its home page and a guide carry the navigation and the headings, the
config reference holds the tables generated from the schema, and the API pages the docstrings.

The site is built here, strict, into a scratch directory (``make docs`` builds ``site/`` the
same way), and the HTML is read with the standard library's parser.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.docs.snippets import ROOT

pytestmark = [
    pytest.mark.light,
    pytest.mark.skipif(
        importlib.util.find_spec("mkdocs") is None
        or importlib.util.find_spec("material") is None
        or importlib.util.find_spec("mkdocstrings") is None,
        reason="mkdocs, mkdocs-material or mkdocstrings is not installed (the docs extra)",
    ),
]


class Page(HTMLParser):
    """Headings, navigation entries and table cells of one HTML page, as their visible text."""

    CAPTURED = ("h1", "h2", "h3", "a", "label", "td")

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.headings: dict[str, list[str]] = {"h1": [], "h2": [], "h3": []}
        self.nav: list[str] = []
        self.cells: list[str] = []
        self._open: list[tuple[str, list[str]]] = []  # captured elements and their text so far
        self._navs: list[bool] = []  # per open <nav>: is it Material's navigation

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "nav":
            self._navs.append("md-nav" in (dict(attrs).get("class") or ""))
        if tag == "img":
            self.images.append(dict(attrs).get("src") or "")
        if tag in self.CAPTURED:
            self._open.append((tag, []))

    def handle_endtag(self, tag: str) -> None:
        if tag == "nav" and self._navs:
            self._navs.pop()
        if tag not in self.CAPTURED or not self._open or self._open[-1][0] != tag:
            return
        _, parts = self._open.pop()
        text = " ".join("".join(parts).replace("\u00b6", "").split())
        if tag in self.headings:
            self.headings[tag].append(text)
        elif tag == "td":
            self.cells.append(text)
        elif any(self._navs) and text:
            self.nav.append(text)

    def handle_data(self, data: str) -> None:
        for _, parts in self._open:
            parts.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=240,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def read(site: Path, page: str) -> Page:
    parsed = Page()
    parsed.feed((site / page / "index.html").read_text(encoding="utf-8"))
    return parsed


def test_the_home_page_renders_with_the_navigation(site: Path) -> None:
    home = read(site, ".")
    assert home.headings["h1"] == ["flodl"]
    assert "Start here" in home.headings["h2"]
    for section in ("Tutorials", "Guides", "Design", "Reference", "Benchmarks"):
        assert section in home.nav, (section, home.nav)
    for entry in ("From one device to many", "Your own project with Hydra", "Troubleshooting"):
        assert entry in home.nav, (entry, home.nav)


def test_a_guide_renders_its_headings_and_the_navigation(site: Path) -> None:
    guide = read(site, "guides/modes-elche")
    assert guide.headings["h1"] == ["Modes and ElChe"]
    assert {"The modes", "How ElChe decides", "The knobs"} <= set(guide.headings["h2"])
    assert "Modes and ElChe" in guide.nav and "Configuration" in guide.nav
    assert "nccl_cadence (default)" in guide.cells


def test_the_config_reference_is_generated_from_the_schema(site: Path) -> None:
    from flodl.config import ElCheConfig

    ref = read(site, "reference/config")
    keys = {cell for cell in ref.cells if cell.startswith(("elche.", "trainer.", "cluster."))}
    assert {f"elche.{name}" for name in ElCheConfig.model_fields} <= keys
    assert {"trainer.save_path", "cluster.workers[].ssh.user"} <= keys


def test_the_api_pages_carry_the_docstrings(site: Path) -> None:
    api = read(site, "reference/api/trainer")
    names = " ".join(api.headings["h2"] + api.headings["h3"])
    assert "Trainer" in names and "TrainerBuilder" in names and "RunHandle" in names


def test_the_benchmark_page_shows_its_tables_and_plots(site: Path) -> None:
    bench = read(site, "benchmarks")
    assert bench.headings["h1"] == ["Benchmarks"]
    assert "nccl_cadence" in " ".join(bench.cells)
    pngs = [src for src in bench.images if src.endswith(".png")]
    assert pngs, "no plot on the benchmarks page"
    for src in pngs:  # served from bench/results by the bench_assets hook
        assert (site / "benchmarks" / src).is_file(), src
