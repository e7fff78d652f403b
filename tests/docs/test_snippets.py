"""Every code block of README.md, bench/README.md and docs/ is run here, or parsed and validated
when it is marked as not runnable on this machine (the convention: docs/contributing.md).

A block that drifts from the API (a renamed builder method, a config key the schema no longer
has, an error message that changed) fails here. The blocks that start rank processes run in
test_snippet_ranks.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runner import JOBS, SLOW, SNIPPETS, check_static, run_jobs
from tests.docs.snippets import LANGS, Snippet


@pytest.mark.light
def test_every_block_names_a_language() -> None:
    bad = [s.id for s in SNIPPETS if s.lang not in LANGS]
    assert not bad, f"fence these with one of {sorted(LANGS)}: {bad}"


@pytest.mark.light
def test_every_skip_says_why() -> None:
    bad = [s.id for s in SNIPPETS if "skip" in s.opts and not s.opts.get("reason")]
    assert not bad, f"`<!-- snippet: skip reason=... -->` needs its reason: {bad}"


@pytest.mark.light
@pytest.mark.parametrize("s", [pytest.param(s, id=s.id) for s in SNIPPETS if s.lang != "text"])
def test_block_parses_and_validates(s: Snippet) -> None:
    check_static(s)


def test_the_blocks_that_run_in_one_process(tmp_path: Path) -> None:
    """Python blocks that train in-process, refusals, small scripts."""
    run_jobs([key for key in JOBS if key not in SLOW], tmp_path)


@pytest.mark.light
def test_runnable_blocks_are_found() -> None:
    """The collector sees the runnable blocks (a broken fence would silently drop them)."""
    assert len(JOBS) >= 15 and SLOW, sorted(JOBS)


@pytest.mark.light
def test_the_config_reference_names_every_option_on_disk() -> None:
    """The groups table of docs/reference/config.md is prose, so it is checked against conf/:
    every option a user can pick (conf/<group>/<option>.yaml) is named there."""
    from tests.docs.snippets import ROOT

    conf = ROOT / "conf"
    page = (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    table = page[page.index("## Groups and options") : page.index("## Every key")]
    missing = [
        f"{group.name}={option.stem}"
        for group in sorted(p for p in conf.iterdir() if p.is_dir())
        for option in sorted(group.glob("*.yaml"))
        if not option.stem.startswith("_") and f"`{option.stem}`" not in table
    ]
    assert not missing, f"name these in the groups table of docs/reference/config.md: {missing}"
