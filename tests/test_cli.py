"""Bad input gets one clear line, a non-zero exit, and nothing on disk; `list` and `score` work."""

import json
import subprocess
import sys

import pytest
from conftest import TOY
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
