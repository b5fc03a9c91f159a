"""Bad input gets one clear line, a non-zero exit, and nothing on disk; `list` and `score` work."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import TOY
from stabench.suite.api import StabenchError
from stabench.suite.cli import main

pytestmark = pytest.mark.smoke


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--tasks", "no-such-task"], "unknown task 'no-such-task'"),
        (["run", "--tier", "huge"], "unknown tier 'huge'"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--methods", "no-such-fix"], "unknown stabilizer 'no-such-fix'"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--stabilizer", "/nowhere/fix.py:Fix"], "does not exist"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--stabilizer", f"{TOY}:NoSuchClass"], "has no 'NoSuchClass'"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--address", "127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--address", "nonsense"], "must look like HOST:PORT"),
        (["run", "--seeds", "many"], "invalid int value: 'many'"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--seeds", "0"], "--seeds must be at least 1"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--seed-start", "-1"], "--seed-start must be at least 0"),
        (["score", "/no/such/dir"], "no metrics.parquet in /no/such/dir"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--cpus", "0"], "--cpus must be at least 1"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--detector", f"{TOY}:ToyFix"],
         "is not a stabench.suite.api.Detector subclass"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--stabilizer", f"{TOY}:ClashingName"], "not used by a built-in"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--methods", "kl-max"], "does not apply to task"),
        (["run", "--tasks", f"{TOY}:NoSuchTask"], "has no 'NoSuchTask'"),
        (["run", "--family", "poetry"], "unknown family poetry"),
        (["run", "--tasks", "dead-layers", "--family", "reasoning"], "no requested task belongs to the family"),
        (["paper", "/no/such/dir", "--out", "{out}"], "no metrics.parquet in /no/such/dir"),
        (["verify", "/no/such/run", "--leaderboard", "{out}/lb.csv"], "is not a finished run"),
    ],
)
def test_bad_input_is_one_line_nonzero_and_writes_nothing(capsys, tmp_path, argv, message):
    out_dir = tmp_path / "out"
    argv = [a.replace("{out}", str(out_dir)) for a in argv]
    if argv[0] == "run":
        argv = [*argv, "--out", str(out_dir)] + ([] if "--tier" in argv else ["--tier", "smoke"])
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("stabench: error:") and message in err
    assert not out_dir.exists()


def test_an_output_folder_with_another_experiment_is_refused_without_resume(capsys, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "metrics.parquet").write_bytes(b"someone else's results")
    before = sorted(p.name for p in out_dir.iterdir())
    code, _, err = run_cli(capsys, "run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask", "--out", str(out_dir))
    assert code == 2 and "already holds files; pass --resume" in err
    assert sorted(p.name for p in out_dir.iterdir()) == before
    assert (out_dir / "metrics.parquet").read_bytes() == b"someone else's results"
    code, _, err = run_cli(capsys, "run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask", "--out", str(out_dir),
                           "--resume")
    assert code == 2 and "nothing to resume" in err


def test_unreadable_results_and_unknown_names_in_a_run_are_one_line(capsys, tmp_path):
    (tmp_path / "metrics.parquet").write_bytes(b"not parquet at all")
    before = (tmp_path / "metrics.parquet").read_bytes()
    code, _, err = run_cli(capsys, "score", str(tmp_path))
    assert code == 2 and "cannot read" in err and err.count("\n") == 1
    assert (tmp_path / "metrics.parquet").read_bytes() == before


def test_list_names_every_registry_through_the_console_script():
    proc = subprocess.run([sys.executable, "-m", "stabench.suite.cli", "list"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("dead-layers", "kl-estimator-bias", "multiskip-residual", "kl-max", "threshold", "grad_norms"):
        assert name in proc.stdout


def test_score_json_has_both_tracks_schema(capsys, tmp_path):
    import pandas as pd
    from test_harness import toy_trial

    pd.concat([toy_trial("baseline", 0), toy_trial(f"{TOY}:ToyFix", 0)]).to_parquet(tmp_path / "metrics.parquet")
    code, out, _ = run_cli(capsys, "score", str(tmp_path), "--json")
    assert code == 0
    result = json.loads(out)
    rows = result["stabilizer_track"]
    keys = {"task", "method", "role", "failure_rate", "control_failure_rate", "normalized_return", "ci_low",
            "ci_high", "n_seeds"}
    assert len(rows) == 2 and all(keys <= set(r) for r in rows)
    assert {r["role"] for r in rows} == {"baseline", "matched-fix"}
    detector_keys = {"task", "detector", "diagnostic", "detection_rate", "median_latency_steps",
                     "median_latency_frac", "false_alarms_per_1k", "score"}
    detectors = {r["detector"]: r for r in result["detector_track"]}
    assert all(detector_keys <= set(r) for r in detectors.values())
    assert {"never", "always", "oracle", "random", "cusum", "page-hinkley", "calibrated-threshold"} <= set(detectors)
    assert detectors["oracle"]["score"] == 100.0
    assert {r["method"] for r in result["aggregate"]} == {"baseline", "toy-fix"}


def toy_run_folder(folder: Path, tier: str = "smoke", version: str | None = None) -> pd.DataFrame:
    """A finished run folder of the toy task (baseline and its fix, one seed); `version` edits its task_version."""
    from test_harness import toy_trial

    table = pd.concat([toy_trial("baseline", 0), toy_trial(f"{TOY}:ToyFix", 0)], ignore_index=True)
    if version is not None:
        table["task_version"] = version
    folder.mkdir(parents=True)
    table.to_parquet(folder / "metrics.parquet")
    manifest = {"spec": {"tier": tier}, "suite_version": str(table["suite_version"].iloc[0])}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    trials = table[["task_ref", "method", "seed"]].drop_duplicates().rename(columns={"task_ref": "task"})
    trials.assign(status="ok", retries=0).to_csv(folder / "trials.csv", index=False)
    return table


REFUSED = "toy: the rows were made by task version 0, this suite's toy is version 1"


@pytest.mark.parametrize("argv", [["score"], ["score", "--json"], ["score", "--calibration"],
                                  ["paper", "--out", "{out}"]])
def test_rows_of_another_task_version_are_refused_in_one_line_naming_both_versions(capsys, tmp_path, argv):
    run = tmp_path / "run"
    toy_run_folder(run, version="0")
    argv = [a.replace("{out}", str(tmp_path / "paper")) for a in argv]
    code, out, err = run_cli(capsys, argv[0], str(run), *argv[1:])
    assert code == 2 and err.count("\n") == 1 and err.startswith("stabench: error:"), err
    assert REFUSED in err and out == ""
    toy_run_folder(tmp_path / "same", version="1")  # the registry's own version scores
    assert run_cli(capsys, "score", str(tmp_path / "same"))[0] == 0


def test_verify_refuses_leaderboard_rows_once_the_task_version_moved(capsys, tmp_path, monkeypatch):
    from stabench.suite import leaderboard, registry

    run, board = tmp_path / "run", tmp_path / "leaderboard.csv"
    table = toy_run_folder(run)
    manifest = json.loads((run / "manifest.json").read_text())
    leaderboard._write(board, leaderboard.compute_rows(table, manifest, ["baseline"], []))
    code, out, _ = run_cli(capsys, "verify", str(run), "--leaderboard", str(board))
    assert code == 0 and "0 mismatches" in out
    monkeypatch.setattr(registry.resolve_class("task", f"{TOY}:ToyTask"), "version", "2")  # the task moved on
    code, out, err = run_cli(capsys, "verify", str(run), "--leaderboard", str(board))
    assert code == 2 and err.count("\n") == 1
    assert "toy: the rows were made by task version 1, this suite's toy is version 2" in err


def test_the_public_run_and_score_are_the_library_calls_the_command_makes(capsys, tmp_path, monkeypatch):
    from stabench.suite import scoring, sweep
    from stabench.suite.results import load_tables

    import stabench

    assert stabench.run is sweep.run_sweep
    run = tmp_path / "run"
    table = toy_run_folder(run)
    pd.testing.assert_frame_equal(load_tables([run]), table)
    ours, direct = stabench.score(run), scoring.score(table)
    code, out, _ = run_cli(capsys, "score", str(run), "--json")
    assert code == 0
    printed = json.loads(out)
    for track in ("stabilizer_track", "aggregate", "detector_track"):
        assert pd.DataFrame(ours[track]).equals(pd.DataFrame(direct[track])), track
        assert pd.DataFrame(printed[track]).equals(pd.DataFrame(direct[track])), track
    with pytest.raises(StabenchError, match="the runs overlap"):  # the same folder twice: the library refuses
        stabench.score(run, run)
    calls = []
    monkeypatch.setattr(sweep, "run_sweep", lambda tasks, **kw: calls.append((tasks, kw)) or Path(kw["out"]))
    code, out, _ = run_cli(capsys, "run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask", "--seeds", "2",
                           "--out", str(tmp_path / "out"))
    assert code == 0 and out.strip() == str(tmp_path / "out")
    (tasks, kw), = calls
    assert tasks == (f"{TOY}:ToyTask",) and kw["tier"] == "smoke" and kw["seeds"] == 2 and not kw["matrix"]


def test_list_says_which_tiers_are_calibrated(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0
    tiers = out.split("tiers:\n", 1)[1].split("\ntasks:\n", 1)[0].splitlines()
    assert len(tiers) == 3
    assert tiers[1].split()[0] == "quick" and "calibrated (results/calibration.md)" in tiers[1]
    assert tiers[2].split()[0] == "full" and "NOT calibrated for the redesigned tasks" in tiers[2]


@pytest.mark.parametrize(("tier", "warned"), [("full", True), ("quick", False), ("smoke", False)])
def test_run_on_an_uncalibrated_tier_prints_one_warning_line(capsys, tmp_path, monkeypatch, tier, warned):
    from stabench.suite import runner

    monkeypatch.setattr(runner, "execute", lambda *args, **kwargs: None)  # the request, not the training
    code, out, err = run_cli(capsys, "run", "--tier", tier, "--tasks", f"{TOY}:ToyTask", "--out", str(tmp_path / "o"))
    assert code == 0
    lines = [line for line in err.splitlines() if line.startswith("stabench: warning:")]
    if warned:
        assert lines == ["stabench: warning: the full tier is not calibrated for the redesigned tasks "
                         "(results/calibration.md covers quick): its scores are not the suite's claims, and "
                         "`stabench submit` refuses them"]
    else:
        assert lines == []


def test_submit_refuses_an_uncalibrated_tier_and_writes_nothing(capsys, tmp_path):
    run, board = tmp_path / "run", tmp_path / "board" / "leaderboard.csv"
    toy_run_folder(run, tier="full")
    code, out, err = run_cli(capsys, "submit", str(run), "--leaderboard", str(board))
    assert code == 2 and err.count("\n") == 1 and out == ""
    assert err.startswith("stabench: error: the full tier is not calibrated for the redesigned tasks")
    assert not board.parent.exists()
