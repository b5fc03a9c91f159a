"""`stabench submit` refuses a stabilizer row whose run lacks its own controls: on every task and seed of the method,
the baseline and both references, at the same tier. One line, exit 2, the leaderboard byte-identical.

The folders are the toy task's (milliseconds per trial), on the smoke tier; the suite's default tasks are hidden
from `validate_run` so that a toy folder counts as a complete grid."""

import json
from pathlib import Path

import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import registry
from stabench.suite.api import REFERENCE_METHODS
from test_cli import run_cli

pytestmark = pytest.mark.smoke

FIX = f"{TOY}:ToyFix"


@pytest.fixture(scope="module")
def toy_table():
    """The toy task's baseline, both references and its fix (`toy-fix`) on seeds 0-2 of the smoke tier."""
    from test_harness import toy_trial

    return pd.concat([toy_trial(m, s) for m in ("baseline", *REFERENCE_METHODS, FIX) for s in range(3)],
                     ignore_index=True)


@pytest.fixture(autouse=True)
def toy_is_the_whole_suite(monkeypatch):
    names = registry.names
    monkeypatch.setattr(registry, "names", lambda kind: [] if kind == "task" else names(kind))


def folder(path: Path, table: pd.DataFrame) -> Path:
    path.mkdir(parents=True)
    table.to_parquet(path / "metrics.parquet")
    manifest = {"spec": {"tier": "smoke"}, "suite_version": str(table["suite_version"].iloc[0])}
    (path / "manifest.json").write_text(json.dumps(manifest))
    trials = table[["task_ref", "method", "seed"]].drop_duplicates().rename(columns={"task_ref": "task"})
    trials.assign(status="ok", retries=0).to_csv(path / "trials.csv", index=False)
    return path


def spoil(table: pd.DataFrame, kind: str) -> pd.DataFrame:
    if kind == "the method alone":  # a run of `--methods my-fix`
        return table[table.method == "toy-fix"]
    if kind == "no frozen-at-onset":
        return table[table.method != "frozen-at-onset"]
    if kind == "a baseline on fewer seeds":  # 2 seeds: the smoke tier's minimum, so only the new rule refuses it
        return table[(table.method != "baseline") | (table.seed < 2)]
    if kind == "a reference at another tier":
        return table.assign(tier=table.tier.where(table.method != "no-update", "quick"))
    raise AssertionError(kind)


def test_a_run_with_its_own_controls_is_accepted(capsys, tmp_path, toy_table):
    board = tmp_path / "leaderboard.csv"
    code, out, err = run_cli(capsys, "submit", str(folder(tmp_path / "run", toy_table)), "--method", "toy-fix",
                             "--leaderboard", str(board))
    assert code == 0, err
    assert "added: stabilizer toy-fix (smoke)" in out


@pytest.mark.parametrize(("kind", "message"), [
    ("the method alone", "on toy it ran on seeds 0-2 and baseline has no runs"),
    ("no frozen-at-onset", "on toy it ran on seeds 0-2 and frozen-at-onset has no runs"),
    ("a baseline on fewer seeds", "on toy it ran on seeds 0-2 and baseline has seeds 0-1 at tier smoke"),
    ("a reference at another tier", "on toy it ran on seeds 0-2 and no-update has seeds 0-2 at tier quick"),
])
def test_a_run_without_its_own_controls_is_refused_in_one_line(capsys, tmp_path, toy_table, kind, message):
    board = tmp_path / "leaderboard.csv"
    assert run_cli(capsys, "submit", str(folder(tmp_path / "good", toy_table)), "--method", "toy-fix",
                   "--leaderboard", str(board))[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    run = folder(tmp_path / "bad", spoil(toy_table, kind))
    for argv in (["--method", "toy-fix"], []):  # the method named, or every row of the run
        code, out, err = run_cli(capsys, "submit", str(run), *argv, "--leaderboard", str(board))
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith("stabench: error: ") and "cannot be scored from this run" in err
        if argv:
            assert f"toy-fix cannot be scored from this run: {message}" in err, err
        assert "baseline and both references (no-update, frozen-at-onset)" in err
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before  # board and .md


def test_detector_rows_need_no_references(capsys, tmp_path, toy_table):
    """A detector row scores every run of the grid but the references' (`skill.detector_rows`): it is not read
    against them, so a run without them still gives detector rows."""
    board = tmp_path / "leaderboard.csv"
    run = folder(tmp_path / "run", spoil(toy_table, "no frozen-at-onset"))
    code, out, err = run_cli(capsys, "submit", str(run), "--detector", "never", "--leaderboard", str(board))
    assert code == 0, err
    assert "added: detector never (smoke)" in out
