"""bench/ddp_bench_report.py: time-to-loss and the goal verdicts, on made-up results."""

from __future__ import annotations

import pytest

from bench.ddp_bench_report import goals_table, results_table, time_to


def test_time_to_interpolates_between_evals_and_says_never() -> None:
    curve = [[10.0, 0, 2.0], [20.0, 1, 1.6], [30.0, 2, 1.4]]
    assert time_to(curve, 2.5) == 10.0  # already there at the first eval
    assert time_to(curve, 1.8) == pytest.approx(15.0)
    assert time_to(curve, 1.4) == pytest.approx(30.0)
    assert time_to(curve, 1.3) is None


def _row(workload, variant, eval_, curve=None, **extra):
    return {"workload": workload, "variant": variant, "status": "ok", "final_loss": 1.0,
            "eval": eval_, "total_s": 5.0, "syncs": 3, "curve": curve or [], **extra}  # fmt: skip


def _data(rows):
    workloads = {
        "lenet": {"higher_is_better": True},
        "char_rnn": {"higher_is_better": False},
        "gpt_nano": {"higher_is_better": False},
    }
    variants = ["solo-fast", "solo-slow", "ddp", "nccl_cadence"]
    return {"settings": {"workloads": workloads, "variants": variants}, "rows": rows}


def test_goals_compare_with_solo_and_time_to_its_loss() -> None:
    rows = [
        _row("lenet", "solo-fast", 0.950),
        _row("lenet", "ddp", 0.947),  # 0.3 pt behind: ok
        _row("lenet", "nccl_cadence", 0.940),  # 1.0 pt behind: missed
        _row("char_rnn", "solo-fast", 2.00, [[10, 0, 2.5], [20, 1, 2.0]]),
        _row("char_rnn", "ddp", 2.03, [[10, 0, 2.6], [20, 1, 2.1], [40, 2, 1.9]]),  # +1.5 %
        _row("char_rnn", "nccl_cadence", 2.10, [[5, 0, 2.4], [10, 1, 2.0]]),  # +5 %: missed
    ]
    table = goals_table(_data(rows))
    agreement = table.split("\n\n")[0].splitlines()  # the first of the two tables
    lines = {line.split(" | ")[0].strip("| "): line for line in agreement}
    assert "+0.3 pt ok" in lines["lenet"] and "+1.0 pt MISSED" in lines["lenet"]
    assert "+1.5 % ok" in lines["char_rnn"] and "+5.0 % MISSED" in lines["char_rnn"]
    # time to solo's 2.00: cadence at 10 s, DDP between 20 s (2.1) and 40 s (1.9): 30 s
    assert "| char_rnn | 2.0000 | 10.0 s / 30.0 s | 0.33 ok |" in table
    assert "| gpt_nano | \u2013 | not measured | \u2013 |" in table


def test_results_table_is_the_original_format() -> None:
    rows = [_row("lenet", "solo-fast", 0.95), _row("lenet", "ddp", 0.94)]
    rows.append({"workload": "lenet", "variant": "nccl_cadence", "status": "failed"})
    table = results_table(_data(rows))
    assert "| solo-fast | 1.0000/0.9500/5.0/\u2013 |" in table
    assert "| ddp | 1.0000/0.9400/5.0/3 |" in table and "| nccl_cadence | failed |" in table


def test_beside_the_goal_the_time_to_ddps_own_final_loss() -> None:
    rows = [
        _row("char_rnn", "solo-fast", 1.80, [[10, 0, 2.2], [20, 1, 1.8]]),
        _row("char_rnn", "ddp", 2.00, [[20, 0, 2.4], [40, 1, 2.0]]),  # its own final at 40 s
        _row("char_rnn", "nccl_cadence", 1.90, [[10, 0, 2.2], [20, 1, 1.9]]),  # 2.0 at 16.7 s
    ]
    data = _data(rows)
    data["settings"]["workloads"].pop("gpt_nano")
    table = goals_table(data)
    never = "| char_rnn | 1.8000 | \u2013 s / \u2013 s | not reached by nccl_cadence and DDP |"
    assert never in table
    assert "| char_rnn | 2.0000 | 16.7 | 40.0 | 0.42 |" in table
    assert "gpt_nano" not in table  # only the language models that ran
    data["settings"]["workloads"].pop("char_rnn")
    assert "language model" not in goals_table(data)  # a vision-only block has no LM tables


def test_the_ddp_baseline_scales_its_lr_by_flodls_rule() -> None:
    import torch

    from bench.ddp_bench import compose_config
    from bench.ddp_worker import _scheduler, scaled_optimizer
    from flodl.config import validate_run_config

    for ratio, world, lr in ((0.0, 2, 3e-4), (1.0, 2, 6e-4), (0.5, 3, 6e-4), (1.0, 1, 3e-4)):
        plain = compose_config("gpt_nano", "ddp", [f"trainer.lr_scale_ratio={ratio}"])
        run_cfg = validate_run_config(plain)
        params = [torch.nn.Parameter(torch.zeros(2))]
        optimizer = scaled_optimizer(run_cfg, params, world)
        scheduler, per_step = _scheduler(run_cfg, optimizer, 100)
        assert per_step  # gpt_nano's warm-up + cosine advances per step
        assert scheduler.base_lrs == pytest.approx([lr]), (ratio, world)  # what it schedules
        assert 0.0 < optimizer.param_groups[0]["lr"] < lr / 10  # the warm-up's first step


def test_lr_line_says_whether_the_two_rank_cells_scale() -> None:
    from bench.ddp_bench_report import lr_line

    assert lr_line(0.0, 2) == "no LR scaling (lr_scale_ratio 0.0): every cell trains at solo's LR"
    assert lr_line(1.0, 2).startswith("LR scaled on 2 ranks by 2 (lr_scale_ratio 1;")
    assert "by 1.5 (lr_scale_ratio 0.25;" in lr_line(0.25, 3)


def test_the_anchor_line_gives_a_verdict_per_two_rank_variant() -> None:
    from bench.ddp_bench_report import NANOGPT_TOKENS, anchor_line

    rows = [
        _row("gpt_nano", "solo-fast", 1.95, total_s=160.0),
        _row("gpt_nano", "nccl_cadence", 1.87, total_s=120.0),  # low enough and sooner: ok
        _row("gpt_nano", "ddp", 1.86, total_s=170.0),  # low enough, not sooner: missed
    ]
    data = _data(rows)
    data["settings"]["workloads"]["gpt_nano"].update(epochs=2, tokens_per_epoch=768_000)
    line = anchor_line(data)
    assert line.startswith(f"nanoGPT anchor after {NANOGPT_TOKENS:,} tokens (goal <= 1.88): ")
    assert "solo-fast 1.9500 in 160 s" in line
    assert "nccl_cadence: ok (<= 1.88, sooner than solo-fast)" in line
    assert "ddp: MISSED (<= 1.88, not sooner than solo-fast)" in line
    data["settings"]["workloads"]["gpt_nano"].update(epochs=1)
    assert "**not measured**" in anchor_line(data)  # half the tokens


def test_the_anchor_preset_trains_nanogpts_tokens_at_its_settings() -> None:
    from bench.ddp_bench import ANCHOR, _describe
    from bench.ddp_bench_report import NANOGPT_TOKENS

    d = _describe("gpt_nano", ANCHOR)
    assert d["epochs"] * d["tokens_per_epoch"] == NANOGPT_TOKENS  # 1,536,000
    assert d["epochs"] * d["train_samples"] // d["batch_size"] == 2000  # the baby GPT's iterations
    assert d["optimizer"]["lr"] == 0.001 and list(d["optimizer"]["betas"]) == [0.9, 0.99]
    assert d["scheduler"]["warmup_fraction"] == 0.05 and d["scheduler"]["floor"] == 0.1


def test_the_ddp_baseline_evaluates_the_tasks_metric_as_flodl_does() -> None:
    import torch

    from bench.ddp_bench import compose_config
    from bench.ddp_worker import evaluator
    from flodl.cli.app import build_dataset, build_model
    from flodl.config import validate_run_config
    from flodl.recipes.steps import val_loss

    for workload in ("logistic", "char_rnn"):  # metrics (accuracy) and a legacy eval_fn
        run_cfg = validate_run_config(
            compose_config(
                workload, "ddp", ["dataset.max_chars=20000"] if workload != "logistic" else []
            )
        )
        torch.manual_seed(0)
        model = build_model(run_cfg.model, torch.device("cpu"))
        x, y = build_dataset(run_cfg.dataset, "test").tensors
        value = evaluator(run_cfg, x, y)(model)
        with torch.no_grad():
            model.eval()
            expected = (
                float((model(x).argmax(dim=1) == y).double().mean())
                if workload == "logistic"
                else val_loss(model, x, y)
            )
        assert value == pytest.approx(expected, rel=1e-6), workload


def test_a_vision_cell_of_the_grid_is_evaluated() -> None:
    """The classification task evaluates through metrics (no eval_fn): the cell has its eval."""
    from bench.ddp_bench import run_one

    res = run_one(
        {"workload": "logistic", "variant": "solo-fast", "extra": ["trainer.num_epochs=1"]}
    )
    assert res["status"] == "ok"
    assert 0.5 < res["eval"] <= 1.0  # accuracy after one epoch (0.857 measured)
    assert [point[1] for point in res["curve"]] == [1]  # one eval, after epoch 1


def test_merge_redoes_only_the_cells_it_runs(tmp_path, monkeypatch) -> None:
    """``--merge`` keeps the results file's rows a run does not redo (other workloads, or other
    variants of the same workload) and says where they came from; fake cells, no training."""
    import json

    import bench.ddp_bench as grid

    monkeypatch.setattr(grid, "RESULTS", tmp_path)
    monkeypatch.setattr(grid, "write_result", lambda name, data: _write(tmp_path, name, data))
    monkeypatch.setattr(grid, "wait_quiet", lambda *_: {})
    value = {"v": 1.0}
    monkeypatch.setattr(
        grid, "_describe", lambda w, extra: {"w": w, "lr_scale_ratio": value["v"] / 4}
    )
    monkeypatch.setattr(
        grid,
        "run_isolated",
        lambda _m, payload, _t: {
            "status": "ok",
            "final_loss": value["v"],
            "eval": value["v"],
            "total_s": 1.0,
            "syncs": 1,
        },
    )
    grid.main(["--workloads", "mlp", "lenet", "--variants", "solo-fast", "ddp", "--out", "g"])
    value["v"] = 2.0
    first = json.loads((tmp_path / "g.json").read_text())
    for described in first["settings"]["workloads"].values():
        del described["lr_scale_ratio"]  # as older results files hold them
    (tmp_path / "g.json").write_text(json.dumps(first))
    grid.main(["--merge", "--workloads", "lenet", "--variants", "ddp", "--out", "g"])
    data = json.loads((tmp_path / "g.json").read_text())
    cells = {(r["workload"], r["variant"]): r["eval"] for r in data["rows"]}
    assert cells == {
        ("mlp", "solo-fast"): 1.0,
        ("mlp", "ddp"): 1.0,
        ("lenet", "solo-fast"): 1.0,  # kept: this run did not redo it
        ("lenet", "ddp"): 2.0,  # redone
    }
    assert data["settings"]["variants"] == ["solo-fast", "ddp"]
    (earlier,) = data["settings"]["merged_from"]
    assert earlier["workloads"] == ["lenet", "mlp"] and earlier["variants"] == ["solo-fast", "ddp"]
    assert data["settings"]["lr_scale_ratio"] == 0.5  # this run's, not a kept description's
    from bench.ddp_bench_report import merged_lines

    (line, _) = merged_lines(data)  # one earlier run: mlp whole, lenet's solo-fast only
    assert line.startswith("Rows of mlp, lenet (solo-fast) come from an earlier run (")
    assert line.endswith("`.venv/bin/python -m bench.ddp_bench --workloads mlp lenet "
                         "--variants solo-fast ddp --out g`")  # fmt: skip


def _write(directory, name, data):
    import json

    path = directory / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_the_anchor_block_says_which_rows_an_earlier_run_gave() -> None:
    from bench.ddp_bench_report import anchor_block

    rows = [_row("gpt_nano", "solo-fast", 1.95), _row("gpt_nano", "cpu_async", 2.4)]
    data = _data(rows)
    data["settings"].update(rig=[1.0, 0.4], lr_scale_ratio=1.0, variants=["solo-fast", "cpu_async"])
    data["settings"]["workloads"] = {"gpt_nano": data["settings"]["workloads"]["gpt_nano"]}
    data["settings"]["workloads"]["gpt_nano"].update(
        epochs=2, tokens_per_epoch=768_000, model="m.GPTNano", dataset="d.shakespeare",
        optimizer={"target": "torch.optim.Adam", "lr": 0.001}, batch_size=12, train_samples=12000,
    )  # fmt: skip
    data["command"] = "python -m bench.ddp_bench --anchor --variants cpu_async --merge"
    rows[0]["run"] = {
        "command": "python -m bench.ddp_bench --anchor",
        "date": "2026-12-02 14:31 UTC",
        "load_average": [0.5012, 0.7, 0.6],
    }
    rows[1]["run"] = {"command": data["command"], "date": "later", "load_average": None}
    block = anchor_block(data, "Machine: here.")
    assert (
        "Rows of gpt_nano (solo-fast) come from an earlier run (2026-12-02 14:31 UTC, load "
        "average at start [0.5, 0.7, 0.6]): `.venv/bin/python -m bench.ddp_bench --anchor`"
    ) in block
    assert block.count("come from an earlier run") == 1  # not the run the block is of
    assert "LR scaled on 2 ranks by 2 (lr_scale_ratio 1;" in block
    assert "| cpu_async | 1.0000/2.4000/5.0/3 |" in block
    assert "cpu_async: MISSED (> 1.88, not sooner than solo-fast)" in block


def test_rank_batch_trains_the_two_rank_cells_at_solos_global_batch(monkeypatch) -> None:
    """``--rank-batch N`` sets the 2-rank cells' and torch DDP's per-rank batch, never solo's,
    and the block says so."""
    import bench.ddp_bench as grid
    from bench.ddp_bench_report import rank_batch_line

    sent: list[tuple[str, list[str]]] = []

    def fake_run(_module, payload, _timeout):
        sent.append((payload["variant"], payload["extra"]))
        return {"status": "failed", "error": "not run"}

    monkeypatch.setattr(grid, "run_isolated", fake_run)
    monkeypatch.setattr(grid, "wait_quiet", lambda *_: {})
    monkeypatch.setattr(grid, "write_result", lambda *_: "nowhere")
    monkeypatch.setattr(grid, "exit_on_sigterm", lambda: None)  # pytest's handler stays
    argv = ["--workloads", "char_rnn", "--variants", "solo-fast", "ddp", "nccl_cadence"]
    grid.main([*argv, "--rank-batch", "32", "--out", "never_written"])
    batch = {v: [e for e in extra if e.startswith("trainer.batch_size=")] for v, extra in sent}
    assert batch == {
        "solo-fast": [],
        "ddp": ["trainer.batch_size=32"],
        "nccl_cadence": ["trainer.batch_size=32"],
    }
    assert rank_batch_line(None, 2) == ""
    assert "batch 32 per rank (global 64)" in rank_batch_line(32, 2)
    with pytest.raises(SystemExit):
        grid.main([*argv, "--rank-batch", "0"])


def test_time_to_loss_block_gives_each_variant_against_ddp_and_the_baselines() -> None:
    from bench.ddp_bench_report import time_to_loss_block

    solo = [[10, 0, 2.5], [20, 1, 2.0]]
    rows = [
        _row("gpt_nano", "solo-fast", 2.0, solo, samples_per_s=100.0),
        _row(
            "gpt_nano",
            "ddp",
            1.9,
            [[10, 0, 2.4], [40, 1, 1.9]],
            samples_per_s=110.0,
            nominal_step_ms=100.0,
        ),
        _row(
            "gpt_nano",
            "nccl_cadence",
            1.9,
            [[5, 0, 2.2], [15, 1, 1.9]],
            samples_per_s=180.0,
            nominal_step_ms=100.0,
        ),
        _row("gpt_nano", "diloco", 1.9, [[5, 0, 2.1], [10, 1, 1.9]], samples_per_s=190.0),
        _row("gpt_nano", "fixed_cadence", 2.2, [[5, 0, 2.3], [10, 1, 2.2]], samples_per_s=1.0),
    ]
    workloads = {"gpt_nano": {"overrides": ["cluster.link=1gbe"], "rank_batch": 32}}
    variants = ["solo-fast", "ddp", "nccl_cadence", "diloco", "fixed_cadence"]
    data = {"settings": {"workloads": workloads, "variants": variants}, "rows": rows}
    block = time_to_loss_block(data)
    assert "Link `1gbe`" in block and "per-rank batch 32" in block
    # DDP reaches 2.0 at 10 + 30 * 0.4/0.5 = 34 s; cadence at 5 + 10 * 0.2/0.3 = 11.67 s
    assert (
        "| gpt_nano | nccl_cadence | 1.9000 | 180.0 | 100.0 | 11.7 s | 0.34 | 11.7 s | 0.34 |"
        in block
    )
    assert "nccl_cadence 0.34x DDP's time at equal step (goal <= 0.5: met)" in block
    assert "nccl_cadence vs diloco: 11.7 s / 7.5 s (slower: MISSED)" in block  # diloco: raw
    assert "| gpt_nano | fixed_cadence | 2.2000 | 1.0 | \u2013 | not reached |" in block
    assert "vs fixed_cadence: 11.7 s / not reached (no slower: met)" in block
    # a job that calibrated a step half DDP's ran twice as fast on the wall: at DDP's step, x2
    rows[2]["nominal_step_ms"] = 50.0
    block = time_to_loss_block(data)
    assert "| 50.0 | 11.7 s | 0.34 | 23.3 s | 0.69 |" in block
    assert "nccl_cadence 0.69x DDP's time at equal step (goal <= 0.5: MISSED)" in block


def test_the_baselines_are_flodl_configs_with_elche_off() -> None:
    from bench.ddp_bench import RIG, compose_config

    diloco = compose_config("gpt_nano", "diloco", [])["elche"]
    fixed = compose_config("gpt_nano", "fixed_cadence", [])["elche"]
    for elche in (diloco, fixed):
        assert elche["mode"] == "nccl_cadence" and elche["guard"] == "none"
        assert elche["anchor"] == elche["min_anchor"] == elche["max_anchor"]
        assert elche["meta_controller"] is False
    assert diloco["outer"] == "nesterov" and diloco["partition_ratios"] == [1.0, 1.0]
    assert fixed["outer"] == "average" and fixed["partition_ratios"] == list(RIG)
