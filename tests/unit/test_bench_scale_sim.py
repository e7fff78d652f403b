"""bench.scale_sim's rows and real-run check, their README block, and hetero's variant filter."""

from __future__ import annotations

import argparse
import json

from bench import hetero, render, scale_sim


def test_a_row_has_the_issue_columns_and_renders():
    args = argparse.Namespace(epochs=1, batches_per_rank=30, timing_repeats=1, seed=0)
    row = scale_sim.one_row(4, "two_tiers", args)
    for key in ("ranks", "scenario", "efficiency", "lockstep_efficiency"):
        assert key in row
    assert row["coverage_exact"] is True and row["controller_ms_per_window"] > 0
    data = {
        "machine": {"cpu": "x", "cores": 2, "torch": "t", "python": "p", "date": "d"},
        "settings": {
            "epochs": 1,
            "batches_per_rank": 30,
            "latency_ms": 0.2,
            "workload": {"base_ms": 50.0, "jitter": 0.05, "backward_fraction": 2 / 3},
            "allreduce": {"alpha_ms": 0.05, "beta_gb_s": 12.5, "n_bytes": 10**8},
        },
        "command": "python -m bench.scale_sim",
        "rows": [row],
        "real_check": [],
    }
    block = render.scale_sim_block(data)
    assert f"| 4 | two_tiers | {row['efficiency']:.3f} |" in block
    assert "12.5 GB/s" in block
    # priced by a link profile (--link): the block names it, not the default wire's figures
    data["settings"]["allreduce"] = {"n_bytes": 10**8, "link": "10gbe"}
    block = render.scale_sim_block(data)
    assert "`10gbe` link model" in block and "GB/s" not in block


def test_the_real_check_simulates_the_real_runs_own_step_and_sync(tmp_path, monkeypatch):
    row = {
        "variant": "nccl_cadence",
        "speeds": [1.0, 0.4],
        "efficiency": 0.95,
        "syncs": 8.0,
        "nominal_step_ms": 26.0,
        "mean_sync_ms": 3.4,
    }
    data = {
        "settings": {"batch_size": 64, "epochs": 4, "samples_per_run": 16000},
        "machine": {"load_average": [1.0, 1.0, 1.0]},
        "command": "python -m bench.hetero",
        "rows": [row],
    }
    (tmp_path / "fake.json").write_text(json.dumps(data))
    monkeypatch.setattr(scale_sim, "RESULTS", tmp_path)
    check = scale_sim.real_check("fake")
    assert check is not None
    assert check["sim_syncs"] == 8  # 4 epochs, two windows each, as the real run
    assert abs(check["relative_gap"]) < 0.1
    assert scale_sim.real_check("missing") is None


def test_hetero_runs_only_the_variants_asked_for():
    runs = hetero.plan([[1.0, 0.4]], ["nccl_sync"])
    assert runs == [
        ("solo", [1.0]),
        ("solo", [0.4]),
        ("ddp", [1.0, 0.4]),
        ("nccl_sync", [1.0, 0.4]),
    ]
    assert len(hetero.plan([[1.0, 0.4]])) == 3 + len(hetero.MODES)


def test_hetero_summarises_a_compressed_controller_mode_it_ran():
    def run(sps):
        return {"status": "ok", "samples_per_s": sps, "nominal_step_ms": 100.0, "train_s": 10.0,
                "test_metric": 0.9, "samples": 1000, "syncs": 3}  # fmt: skip

    rep = {
        ("solo", (1.0,)): run(100.0),
        ("solo", (0.4,)): run(40.0),
        ("ddp", (1.0, 0.4)): run(80.0),
        ("cpu_cadence_int8", (1.0, 0.4)): run(120.0)
        | {"averaging": {"averages": 4, "up_bytes": 3_000, "down_bytes": 1_000}},
    }
    rows = hetero.summarise([[1.0, 0.4]], [rep])
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"solo_fast", "solo_slow", "ddp", "cpu_cadence_int8"}
    assert by["cpu_cadence_int8"]["vs_ddp"] == 1.5
    assert by["cpu_cadence_int8"]["bytes_per_average"] == 1_000.0  # (3,000 + 1,000) / 4
    assert by["ddp"]["bytes_per_average"] is None
