"""The paper reads the matrix lean (only the columns scoring and its studies read) and replays change rules in one
loop; both must give what the whole table gives."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from stabench.suite import detectors, paper_inputs, registry
from stabench.suite.detectors import PageHinkley, default_warmup

QUICK = Path(__file__).resolve().parents[1] / "results" / "quick" / "metrics.parquet"


@pytest.fixture(scope="module")
def whole() -> pd.DataFrame:
    return pd.read_parquet(QUICK)


def test_the_lean_read_is_the_whole_table_less_the_columns_nobody_reads(whole):
    lean = paper_inputs.read_lean(QUICK, ("entropy_tool",))
    assert len(lean) == len(whole[whole["cell"].fillna("") == ""])
    assert {"task", "seed", "iteration", "return", "diverged_at", "entropy_tool", "alarm/cusum"} <= set(lean.columns)
    assert "sv/00" not in lean and "grad_norm/00" not in lean  # no score, figure or study of the matrix reads them
    assert len(lean.columns) < len(whole.columns) / 2
    pd.testing.assert_frame_equal(lean, whole[lean.columns], check_exact=True)


def test_replay_rules_gives_the_alarms_of_each_run_replayed_on_its_whole_visible_rows(whole):
    rows = whole[(whole["task"] == "tool-recovery") & whole["seed"].isin([0, 1])]
    task = registry.get_task("tool-recovery")
    budget = task.budget("quick")
    metrics = ["entropy_tool", "entropy", "not_logged"]
    rules = {f"{m}|{d}": (lambda m=m, d=d: PageHinkley(m, default_warmup(budget), above=d == "+",
                                                       onset=budget.onset)) for m in metrics for d in "+-"}
    got = detectors.replay_rules(rows, task, rules, metrics)
    position = pd.Series(np.arange(len(rows)), index=rows.index)
    for name, make in rules.items():
        want = np.zeros(len(rows), bool)
        for _, run in rows.groupby(["method", "seed", "variant"]):
            run = run.sort_values("iteration")
            detector = make()
            want[position[run.index].to_numpy()] = [detector.update(r) for r in
                                                    detectors.visible_frame(run, task).to_dict("records")]
        assert (got[name] == want).all(), name
    assert got["entropy_tool|+"].any() or got["entropy_tool|-"].any()  # the comparison is not between two blanks
    assert not got["not_logged|+"].any()


def test_task_slices_are_the_tracks_rows_of_each_task_as_a_groupby_gives_them(whole):
    from stabench.suite import skill

    table = whole.copy()
    table.loc[table.index[::7], "acts"] = False  # some copies of the baseline's runs: not the track's rows
    got = list(skill.task_slices(table))
    want = [(name, skill.detector_rows(rows)) for name, rows in table.groupby("task")]
    want = [(name, rows) for name, rows in want if len(rows)]
    assert [name for name, _ in got] == [name for name, _ in want]
    for (_, mine), (_, theirs) in zip(got, want):
        pd.testing.assert_frame_equal(mine, theirs, check_exact=True)
    assert not any((rows["role"] == "reference").any() or (~rows["acts"].fillna(True).astype(bool)).any()
                   for _, rows in got)
    cells = dict(skill.task_slices(table, grid=False))
    assert all((rows["cell"].fillna("") == "").all() for rows in cells.values())


def test_the_tracks_rows_cut_to_columns_are_the_whole_rows_less_the_other_columns(whole):
    from stabench.suite import skill

    columns = ["task", "seed", "iteration", "alarm/cusum"]
    cut = skill.detector_rows(whole, columns)
    assert list(cut.columns) == columns
    pd.testing.assert_frame_equal(cut, skill.detector_rows(whole)[columns], check_exact=True)


def test_handing_memory_back_changes_no_frame(whole):
    before = whole.copy()
    paper_inputs.hand_back()
    pd.testing.assert_frame_equal(whole, before, check_exact=True)
