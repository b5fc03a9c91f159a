"""`stabench verify DIR --fresh K`: a row's method and the baseline re-run on seeds drawn at verification time; an
honest smoke row agrees, a tampered or fabricated one gets a clear line and exit 1, and the leaderboard never
changes."""

import json
import re
import subprocess
import sys

import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import leaderboard
from stabench.suite.cli import main
from stabench.suite.trial import TrialSpec, run_trial

pytestmark = pytest.mark.smoke


def stabench(*argv, timeout=600):
    return subprocess.run([sys.executable, "-m", "stabench.suite.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


def _folder(path, table):
    """A finished smoke run folder holding `table` (what `stabench run` writes, as far as verify reads it)."""
    path.mkdir(parents=True)
    table.to_parquet(path / "metrics.parquet")
    manifest = {"spec": {"tier": "smoke"}, "suite_version": str(table["suite_version"].iloc[0])}
    (path / "manifest.json").write_text(json.dumps(manifest))
    trials = table[["task_ref", "method", "seed"]].drop_duplicates().rename(columns={"task_ref": "task"})
    trials.assign(status="ok", retries=0).to_csv(path / "trials.csv", index=False)
    rows = leaderboard.compute_rows(table, manifest, ["baseline", "toy-fix"], [])
    leaderboard._write(path.parent / "leaderboard.csv", rows)
    return path


@pytest.fixture(scope="module")
def toy_table():
    """The toy's baseline (fails after the injected shock) and its fix (holds), seeds 0 and 1."""
    return pd.concat([run_trial(TrialSpec(f"{TOY}:ToyTask", m, s, "smoke"))
                      for m in ("baseline", f"{TOY}:ToyFix") for s in (0, 1)], ignore_index=True)


def _seeds(stdout):
    found = re.search(r"^fresh seeds (\d+)-(\d+) \(repeat this check: .* --seed-start (\d+)\)$", stdout, re.M)
    assert found, stdout
    return int(found.group(1)), int(found.group(2)), int(found.group(3))


def test_an_honest_smoke_row_agrees_on_seeds_drawn_now(toy_table, tmp_path):
    run = _folder(tmp_path / "run", toy_table)
    board = tmp_path / "leaderboard.csv"
    before = board.read_bytes()
    proc = stabench("verify", str(run), "--fresh", "2", "--cpus", "1", "--leaderboard", str(board))
    assert proc.returncode == 0, proc.stderr
    first, last, repeat = _seeds(proc.stdout)
    assert last == first + 1 and repeat == first
    assert not {first, last} & (set(range(10)) | set(range(100, 110)) | {0, 1})  # fresh: no seed of the run
    assert "agrees: stabilizer toy-fix: aggregate 0.9" in proc.stdout
    assert "agrees: stabilizer baseline:" in proc.stdout and "1 tasks' failure-rate verdicts agree" in proc.stdout
    assert "fresh check: 0 rows disagree" in proc.stdout
    assert board.read_bytes() == before


def test_a_tampered_row_gets_one_clear_line_and_exit_1(toy_table, tmp_path):
    run = _folder(tmp_path / "run", toy_table)
    board = tmp_path / "leaderboard.csv"
    rows = leaderboard.read(board)
    fix = next(r for r in rows if r["name"] == "toy-fix")
    fix.update(aggregate="0.990000", ci_low="0.980000", ci_high="1.000000")  # a better number than the runs hold
    base = next(r for r in rows if r["name"] == "baseline")
    base["failures"] = json.dumps({"toy": [0, 2]}, separators=(",", ":"))  # "the baseline never fails"
    for row in rows:
        row["row_digest"] = leaderboard.row_digest(row)  # edited with care: the digest alone cannot tell
    leaderboard._write(board, rows)
    before = board.read_bytes()
    proc = stabench("verify", str(run), "--fresh", "2", "--seed-start", "500000", "--cpus", "1",
                    "--leaderboard", str(board))
    assert proc.returncode == 1, proc.stderr
    assert _seeds(proc.stdout)[:2] == (500000, 500001)  # a printed check repeats on the same seeds
    mismatches = [line for line in proc.stderr.splitlines() if line.startswith("mismatch:")]
    assert any(line.startswith("mismatch: stabilizer toy-fix: aggregate is 0.990000 in the leaderboard")
               for line in mismatches)  # the recomputation from DIR
    assert any(line.startswith("mismatch: stabilizer toy-fix: aggregate ") and line.endswith(
        " on fresh seeds 500000-500001, outside the submitted 0.99 [0.98, 1]") for line in mismatches), mismatches
    assert ("mismatch: stabilizer baseline: failure-rate verdicts flip: toy holds in the row, fails afresh"
            in mismatches)
    assert "fresh check: 2 rows disagree" in proc.stdout
    assert board.read_bytes() == before


def test_a_fabricated_run_passes_the_recomputation_but_not_the_fresh_seeds(toy_table, tmp_path):
    fix = toy_table[toy_table["method"] == "toy-fix"]
    fake = pd.concat([fix.assign(method="baseline", method_ref="baseline", role="baseline"), fix],
                     ignore_index=True)  # the fix's runs passed off as the baseline's: its row is consistent
    run = _folder(tmp_path / "run", fake)
    board = tmp_path / "leaderboard.csv"
    before = board.read_bytes()
    proc = stabench("verify", str(run), "--fresh", "2", "--cpus", "1", "--leaderboard", str(board))
    assert proc.returncode == 1
    assert "1 run folders recomputed; 0 mismatches" in proc.stdout
    line = next(x for x in proc.stderr.splitlines() if x.startswith("mismatch: stabilizer baseline:"))
    assert "outside the submitted 0.9 [0.9, 0.9]" in line and "toy holds in the row, fails afresh" in line
    assert "agrees: stabilizer toy-fix" in proc.stdout
    assert board.read_bytes() == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fresh", "0"], "--fresh must be at least 1 seed"),
        (["--fresh", "-3"], "--fresh must be at least 1 seed"),
        (["--fresh", "2", "--seed-start", "5"], "clear of the seeds the run was made, scored or tuned on"),
        (["--fresh", "2", "--seed-start", "0"], "clear of the seeds the run was made, scored or tuned on"),
    ],
)
def test_bad_fresh_input_is_one_line_exit_2_and_changes_nothing(toy_table, tmp_path, capsys, argv, message):
    run = _folder(tmp_path / "run", toy_table)
    board = tmp_path / "leaderboard.csv"
    before = sorted(p.name for p in tmp_path.rglob("*")), board.read_bytes()
    code = main(["verify", str(run), *argv, "--leaderboard", str(board)])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith("stabench: error:") and message in err, err
    assert (sorted(p.name for p in tmp_path.rglob("*")), board.read_bytes()) == before


def test_fresh_needs_the_run_folder(tmp_path, capsys):
    code = main(["verify", "--fresh", "2", "--leaderboard", str(tmp_path / "lb.csv")])
    assert code == 2 and "name it (stabench verify DIR --fresh K)" in capsys.readouterr().err
