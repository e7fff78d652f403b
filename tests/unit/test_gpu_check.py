"""make gpu-check without CUDA says so and succeeds; its table marks failures."""

from __future__ import annotations

from flodl.cli import gpu_check


def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr("flodl.placement.gpus.detect_gpus", lambda: [])
    assert gpu_check.main([]) == 0
    assert "no CUDA device visible" in capsys.readouterr().out


def test_table_marks_ok_fail_and_skip(capsys):
    gpu_check._print([("a", True, 1.0, "fine"), ("bb", False, 2.5, "boom"), ("c", None, 0, "n/a")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["check", "status", "seconds", "detail"]
    assert [ln.split()[1] for ln in lines[1:]] == ["ok", "FAIL", "skip"]
    assert lines[2].split()[2] == "2.5"
