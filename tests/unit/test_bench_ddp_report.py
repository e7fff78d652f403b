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
