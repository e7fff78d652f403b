"""bench.comm_heavy annotates the file its hetero run wrote, under the caller's --out too."""

from __future__ import annotations

import json

import pytest

from bench import comm_heavy, common, hetero


@pytest.mark.parametrize(
    ("argv", "stem"),
    [(["--quick"], "comm_heavy_quick"), (["--quick", "--out", "mine"], "mine"), ([], "comm_heavy")],
)
def test_the_annotated_file_is_the_one_the_run_wrote(tmp_path, monkeypatch, argv, stem):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(comm_heavy, "RESULTS", tmp_path)
    stale = {"rows": [], "settings": {}, "stale": True}
    (tmp_path / "comm_heavy_quick.json").write_text(json.dumps(stale))  # an earlier run's

    def fake_hetero(args: list[str]) -> int:
        out = args[len(args) - 1 - args[::-1].index("--out") + 1]  # hetero: the last --out
        row = {"variant": "nccl_cadence", "per_repeat": [{"mean_sync_ms": 2.0,
                                                           "nominal_step_ms": 8.0}]}  # fmt: skip
        (tmp_path / f"{out}.json").write_text(json.dumps({"rows": [row], "settings": {}}))
        return 0

    monkeypatch.setattr(hetero, "main", fake_hetero)
    monkeypatch.setattr(comm_heavy, "plot", lambda data, stem: f"{stem}_anchor.png")
    assert comm_heavy.main(argv) == 0
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["benchmark"] == "comm_heavy" and "stale" not in data
    assert data["settings"]["allreduce_fraction"] == pytest.approx(0.2)  # 2 / (2 + 8)
    assert data["settings"]["plot"] == f"{stem}_anchor.png"
    if stem != "comm_heavy_quick":
        assert "benchmark" not in json.loads((tmp_path / "comm_heavy_quick.json").read_text())
