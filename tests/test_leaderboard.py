"""The leaderboard's detector rows: computed on the method matrix (every detector on the same runs, 10 seeds),
replayed only over the rows the track scores, and `verify` naming a folder no row came from instead of failing."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import detectors, leaderboard, registry, statistics
from stabench.suite.cli import main
from stabench.suite.fingerprint import machine_fingerprint
from test_cli import toy_run_folder
from test_harness import toy_trial

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_detector_rows_are_computed_on_the_method_matrix():
    rows = leaderboard.read(ROOT / "results" / "leaderboard.csv")
    digest = leaderboard.results_digest(pd.read_parquet(ROOT / "results" / "matrix" / "metrics.parquet"))
    detector = [r for r in rows if r["track"] == "detector"]
    # every built-in detector has its row: the change rules, the chance and knowledge references, the learned one
    assert sorted(r["name"] for r in detector) == sorted(registry.discover("detector"))
    assert {r["results_digest"] for r in detector} == {digest}
    untuned = [r for r in rows if r["track"] == "stabilizer" and not json.loads(r.get("tuning") or "{}")]
    assert len(untuned) == 38 and {r["results_digest"] for r in untuned} == {digest}
    assert {r["n_seeds"] for r in detector} == {"10"}
    chance = [r for r in detector if r["name"] in ("random", "random-1", "random-20", "never", "always")]
    assert len(chance) == 5
    for row in chance:  # blind to the outcome: about 0, and on 10 seeds of every method a narrow interval
        low, high = float(row["ci_low"]), float(row["ci_high"])
        assert low <= 0 <= high and high - low < 8, row["name"]


def test_a_replayed_detector_reads_only_the_rows_the_track_scores(monkeypatch):
    own = pd.concat([toy_trial(m, s) for m in ("baseline", f"{TOY}:ToyFix") for s in (0, 1)], ignore_index=True)
    base = own[own["method"] == "baseline"]
    table = pd.concat([own.assign(acts=True),
                       base.assign(method="twin", acts=False),  # a method's copy of the baseline (the matrix)
                       base.assign(method="no-update", role="reference", acts=True)], ignore_index=True)
    manifest = {"spec": {"tier": "smoke"}, "suite_version": table["suite_version"].iloc[0]}
    seen = []
    replay = detectors.replay_table
    monkeypatch.setattr(detectors, "replay_table", lambda t, refs: seen.append(set(t["method"])) or replay(t, refs))
    replayed = leaderboard.compute_rows(table.drop(columns="alarm/cusum"), manifest, [], ["cusum"])[0]
    assert seen == [{"baseline", "toy-fix"}]
    recorded = leaderboard.compute_rows(table, manifest, [], ["cusum"])[0]
    for field in leaderboard.SCORE_FIELDS:
        assert replayed[field] == recorded[field], field


def test_verify_names_a_folder_no_row_came_from_and_still_fails_on_a_mismatch(capsys, tmp_path, monkeypatch):
    run, other, board = tmp_path / "run", tmp_path / "other", tmp_path / "leaderboard.csv"
    table = toy_run_folder(run)
    manifest = {"spec": {"tier": "smoke"}, "suite_version": table["suite_version"].iloc[0],
                "fingerprint": machine_fingerprint()}  # built-in rows of one machine: no note on machines
    leaderboard._write(board, leaderboard.compute_rows(table, manifest, ["baseline"], ["cusum"]))
    shutil.copytree(run, other)
    table.iloc[:-1].to_parquet(other / "metrics.parquet")  # another table: no row was computed from it
    capsys.readouterr()
    assert main(["verify", str(run), str(other), "--leaderboard", str(board)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "2 rows intact; 1 run folders recomputed (1 with no row); 0 mismatches"
    assert err == f"note: {other}: no leaderboard row was computed from these results, nothing to recompute\n"
    real = statistics.across_tasks
    monkeypatch.setattr(statistics, "across_tasks", lambda runs: [{**r, "iqm": r["iqm"] + 1} for r in real(runs)])
    assert main(["verify", str(run), str(other), "--leaderboard", str(board)]) == 1
    out, err = capsys.readouterr()
    assert "1 mismatches" in out and "mismatch: stabilizer baseline: aggregate is" in err
