"""`stabench verify DIR --replicate`: a folder's trials re-run on this machine. On the same machine (fingerprint) the
rows are identical; on another the normalized return stays within the tolerance rule declared in the README
(`max(0.05, 3 s sqrt(2/n))`) and no verdict flips; bad input is one line, exit 2, nothing written."""

import hashlib
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import registry, replicate, runner
from stabench.suite.cli import main
from stabench.suite.fingerprint import machine_fingerprint
from stabench.suite.trial import cell_name, run_trial

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]


def stabench(*argv, timeout=600):
    return subprocess.run([sys.executable, "-m", "stabench.suite.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


def folder_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """A finished smoke folder of the toy task (baseline and its fix, seeds 0-1) as the runner writes it: its request,
    manifest (with this machine's fingerprint), trial list and tidy table; the trials run here, without Ray."""
    out = tmp_path_factory.mktemp("toy") / "run"
    spec = runner.ExperimentSpec(tier="smoke", tasks=(registry.canonical(f"{TOY}:ToyTask"),),
                                 methods=("baseline", registry.canonical(f"{TOY}:ToyFix")), seeds=2)
    exp = runner.prepare(out, spec, resume=False)
    table = runner.tidy(pd.concat([run_trial(t) for t in exp.trials], ignore_index=True).assign(acts=True))
    out.mkdir(parents=True)
    runner.write_atomic(table, out / runner.METRICS)
    pd.DataFrame([{**asdict(t), "detectors": ",".join(t.detectors), "knobs": cell_name(t.knobs), "status": "ok",
                   "error": "", "seconds": 0.1, "retries": 0} for t in exp.trials]).to_csv(out / runner.TRIALS,
                                                                                             index=False)
    manifest = exp.manifest
    manifest.setdefault("fingerprint", machine_fingerprint())  # what the runner records (suite/fingerprint.py)
    (out / runner.MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def _copy(folder: Path, dest: Path, edit=None, rows=None) -> Path:
    shutil.copytree(folder, dest)
    if edit is not None:
        manifest = json.loads((dest / runner.MANIFEST).read_text())
        edit(manifest)
        (dest / runner.MANIFEST).write_text(json.dumps(manifest))
    if rows is not None:
        table = pd.read_parquet(dest / runner.METRICS)
        runner.write_atomic(rows(table).reset_index(drop=True), dest / runner.METRICS)
    return dest


def test_a_same_machine_replicate_reproduces_every_row_exactly(toy_run, tmp_path):
    before = folder_digest(toy_run)
    board = tmp_path / "leaderboard.csv"
    proc = stabench("verify", str(toy_run), "--replicate", "--cpus", "1", "--leaderboard", str(board))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("toy baseline: ok: rows identical on seeds 0-1; normalized return 0.0000; "
                               "verdict fails in DIR, fails re-run"), lines
    assert lines[1].startswith("toy toy-fix: ok: rows identical on seeds 0-1; normalized return 0.9000; "
                               "verdict holds in DIR, holds re-run"), lines
    assert lines[2].startswith(f"replicate {toy_run}: 2 of 2 task-method checks ok, 4 trials re-run on seeds 0-1")
    assert lines[2].endswith("the same machine as DIR's: rows compared exactly") and len(lines) == 3
    assert "[  1/4] toy baseline seed=0: ok" in proc.stderr  # the runner's progress, a line per trial
    assert folder_digest(toy_run) == before and not board.exists()  # nothing written, the leaderboard not read


def test_an_edited_fingerprint_goes_through_the_tolerance_path(toy_run, tmp_path):
    other = _copy(toy_run, tmp_path / "run", edit=lambda m: m["fingerprint"].update(cpu_model="Another CPU 9000"))
    assert not replicate.plan(other).exact
    no_print = _copy(toy_run, tmp_path / "old", edit=lambda m: m.pop("fingerprint"))
    assert not replicate.plan(no_print).exact  # a folder made before fingerprints: another machine
    before = folder_digest(other)
    proc = stabench("verify", str(other), "--replicate", "--tasks", "toy", "--seeds", "1", "--cpus", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == ("toy baseline: ok: normalized return 0.0000 in DIR, 0.0000 re-run (difference +0.0000, "
                        "tolerance 0.0500 = max(0.05, 3 x s 0.0000 x sqrt(2/1))); verdict fails in DIR, fails re-run")
    assert lines[1].startswith("toy toy-fix: ok: normalized return 0.9000 in DIR, 0.9000 re-run")
    assert "2 trials re-run on seeds 1" in lines[2] and "another machine than DIR's (Another CPU 9000" in lines[2]
    assert "[  2/2]" in proc.stderr and "[  3/" not in proc.stderr  # only the chosen seed ran
    assert folder_digest(other) == before


def test_exact_comparison_names_the_first_differing_trial_and_column(toy_run):
    table = pd.read_parquet(toy_run / runner.METRICS)
    assert replicate.first_differences(table, table.copy()) == {}  # NaN (the toy's entropy) equals NaN
    changed = table.copy()
    at = changed.index[(changed["method"] == "toy-fix") & (changed["seed"] == 1) & (changed["variant"] == "injected")
                       & (changed["iteration"] == 7)][0]
    changed.loc[at, "return"] += 1e-12
    changed.loc[at + 1, "w"] += 1.0  # a later row: not the first
    found = replicate.first_differences(table, changed)
    assert list(found) == [("toy", "toy-fix")]
    assert found["toy", "toy-fix"].startswith("seed 1 injected iteration 7: return is ")
    assert found["toy", "toy-fix"].endswith("re-run (1 differing value in that column)")
    dropped = replicate.first_differences(table, table.drop(index=at))
    assert dropped == {("toy", "toy-fix"): "seed 1 injected iteration 7: a row of DIR the re-run lacks"}
    checks = replicate.compare_runs(runs_of(table), runs_of(table), exact=True, differences=found)
    assert [c.ok for c in checks] == [True, False]
    assert checks[1].line.startswith("toy toy-fix: mismatch: seed 1 injected iteration 7: return is ")


def runs_of(table):
    from stabench.suite import outcomes

    return outcomes.outcomes(table)


def runs(task: str, method: str, values, failed=None, acts: bool = True, start: int = 0) -> pd.DataFrame:
    """Per-run outcomes as `outcomes.outcomes` gives them: injected runs of one task and method."""
    failed = failed if failed is not None else [False] * len(values)
    return pd.DataFrame({"task": task, "method": method, "seed": range(start, start + len(values)),
                         "variant": "injected", "acts": acts, "failed": failed, "normalized_return": values})


def test_the_tolerance_follows_the_declared_rule():
    a, b = [0.1, 0.3, 0.5, 0.7], [0.4, 0.4, 0.4, 0.4]
    folder = pd.concat([runs("t", "a", a), runs("t", "b", b), runs("t", "copy", a, acts=False),
                        runs("u", "a", [0.5])], ignore_index=True)
    spread = replicate.pooled_spread(folder)
    s = math.sqrt((3 * pd.Series(a).var(ddof=1) + 3 * 0.0) / 6)  # pooled within methods; the copy not again
    assert spread["t"] == pytest.approx(s) and spread["u"] == 0.0  # one seed: no spread, the floor
    assert replicate.tolerance(s, 4) == pytest.approx(max(0.05, 3 * s * math.sqrt(2 / 4)))
    assert replicate.tolerance(0.0, 4) == 0.05 and replicate.tolerance(0.01, 2) == 0.05
    assert replicate.tolerance(0.1, 2) == pytest.approx(0.3) and replicate.tolerance(0.1, 8) == pytest.approx(0.15)
    checks = {(c.task, c.method): c for c in replicate.compare_runs(folder, folder)}
    assert set(checks) == {("t", "a"), ("t", "b"), ("u", "a")}  # the copy is the baseline's check
    tol = 3 * s * math.sqrt(2 / 4)
    assert f"tolerance {tol:.4f} = max(0.05, 3 x s {s:.4f} x sqrt(2/4))" in checks["t", "b"].line  # not zero for b
    # the spread comes from every seed the folder holds, n from the seeds compared
    two = replicate.compare_runs(folder[folder["seed"] < 2], folder[folder["seed"] < 2], spread_runs=folder)
    assert f"tolerance {3 * s:.4f} = max(0.05, 3 x s {s:.4f} x sqrt(2/2))" in two[0].line


@pytest.mark.parametrize(("shift", "ok"), [(0.0, True), (0.9, True), (-0.9, True), (1.1, False), (-1.1, False)])
def test_a_shift_beyond_the_tolerance_is_a_mismatch_within_it_ok(shift, ok):
    folder = pd.concat([runs("t", "a", [0.1, 0.3, 0.5, 0.7]), runs("t", "b", [0.2, 0.4, 0.6, 0.8])],
                       ignore_index=True)
    tol = replicate.tolerance(replicate.pooled_spread(folder)["t"], 4)
    rerun = folder.assign(normalized_return=folder["normalized_return"] + shift * tol * (folder["method"] == "b"))
    checks = replicate.compare_runs(folder, rerun)
    assert checks[0].ok and checks[1].ok is ok
    line = checks[1].line
    assert line.startswith("t b: ok: " if ok else "t b: mismatch: the mean moved by more than the tolerance: ")
    assert f"normalized return 0.5000 in DIR, {0.5 + shift * tol:.4f} re-run (difference {shift * tol:+.4f}, " \
           f"tolerance {tol:.4f}" in line and "verdict holds in DIR, holds re-run" in line


@pytest.mark.parametrize(("before", "after", "ok"), [
    ([True] * 5, [False] * 5, False),  # fails -> holds
    ([False] * 5, [True] * 5, False),  # holds -> fails
    ([True] * 5, [True, True, False, False, True], True),  # fails -> mixed: no flip
    ([True] * 4 + [False], [True] * 5, True),  # fails (80%) -> fails
    ([False] * 4 + [True], [True] * 4 + [False], False),  # holds (20%) -> fails (80%)
])
def test_a_verdict_flip_is_a_mismatch(before, after, ok):
    values = [0.4, 0.5, 0.6, 0.5, 0.5]
    checks = replicate.compare_runs(runs("t", "a", values, before), runs("t", "a", values, after))
    assert checks[0].ok is ok
    if not ok:
        assert checks[0].line.startswith("t a: mismatch: the failure-rate verdict flips: normalized return 0.5000 "
                                         "in DIR, 0.5000 re-run (difference +0.0000")


def test_missing_returns_and_missing_seeds():
    nan = float("nan")
    both = replicate.compare_runs(runs("t", "a", [nan, nan]), runs("t", "a", [nan, nan]))
    assert both[0].ok  # no episode ended on either side: nothing moved
    one = replicate.compare_runs(runs("t", "a", [0.5, 0.5]), runs("t", "a", [nan, nan]))
    assert not one[0].ok and "the mean moved by more than the tolerance" in one[0].line
    lost = replicate.compare_runs(runs("t", "a", [0.5, 0.5]), runs("t", "a", [0.5]))
    assert lost[0].line == ("t a: mismatch: DIR holds seeds 0-1, the re-run 0 (a trial that did not finish: see "
                            "above)")


@pytest.mark.parametrize(("text", "seeds"), [("0-2", (0, 1, 2)), ("0,3,7", (0, 3, 7)), ("7,0-1,1", (0, 1, 7)),
                                             (" 4 ", (4,)), ("3-3", (3,))])
def test_seed_specs(text, seeds):
    assert replicate.parse_seeds(text) == seeds


def _bad_folder(kind: str, toy_run: Path, tmp_path: Path) -> Path:
    if kind == "empty":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty"
    if kind == "no-baseline":
        return _copy(toy_run, tmp_path / "nobase", rows=lambda t: t[t["method"] != "baseline"])
    if kind == "old-version":
        return _copy(toy_run, tmp_path / "old", rows=lambda t: t.assign(task_version="0-old"))
    return toy_run


@pytest.mark.parametrize(("folder", "argv", "message"), [
    ("empty", [], "is not a finished run: metrics.parquet is missing"),
    ("no-baseline", [], "has no baseline runs"),
    ("old-version", [], "toy: the rows were made by task version 0-old"),
    ("toy", ["--tasks", "no-such-task"], "unknown task 'no-such-task'; "),
    ("toy", ["--tasks", "toy,entropy-collapse"], "does not hold task 'entropy-collapse'; it holds toy"),
    ("toy", ["--seeds", "0-5"], "does not hold seeds 2-5 of task toy (it holds 0-1)"),
    ("toy", ["--seeds", "9"], "does not hold seed 9 of task toy"),
    ("toy", ["--seeds", "2-0"], "--seeds '2-0' is not a list of seeds like 0-2 or 0,3,7"),
    ("toy", ["--seeds", "x"], "is not a list of seeds"),
    ("toy", ["--seeds", ""], "is not a list of seeds"),
    ("toy", ["--seeds", "0,,1"], "is not a list of seeds"),
    ("toy", ["--seeds", "-1"], "is not a list of seeds"),
    ("toy", ["--seeds", "1.5"], "is not a list of seeds"),
    ("toy", ["--fresh", "2"], "--replicate re-runs the folder's own seeds; --fresh draws new ones"),
    ("toy", ["--cpus", "0"], "--cpus must be at least 1"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(toy_run, tmp_path, capsys, folder, argv, message):
    path = _bad_folder(folder, toy_run, tmp_path)
    before = folder_digest(path), folder_digest(tmp_path)
    code = main(["verify", str(path), "--replicate", *argv, "--leaderboard", str(tmp_path / "lb.csv")])
    out, err = capsys.readouterr()
    assert code == 2 and not out and err.count("\n") == 1 and err.startswith("stabench: error:"), err
    assert message in err, err
    assert (folder_digest(path), folder_digest(tmp_path)) == before


@pytest.mark.parametrize(("argv", "message"), [
    (["{run}", "--tasks", "toy"], "--tasks and --seeds choose what --replicate re-runs: add --replicate"),
    (["{run}", "--seeds", "0"], "add --replicate"),
    (["--replicate"], "--replicate re-runs one run folder: name one"),
    (["{run}", "{run}", "--replicate"], "name one (stabench verify DIR --replicate), got 2"),
])
def test_replicate_needs_one_folder_and_its_own_options(toy_run, capsys, argv, message):
    code = main(["verify", *(a.format(run=toy_run) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


# Replicating a sample of the committed quick tier, as CI does on whatever CPU it gets: two of its cheapest tasks, two
# seeds, the baseline only (about 19 CPU-seconds of trials plus Ray's start). On the machine that made the folder the
# rows must be identical, elsewhere within the declared tolerance. It runs in a fresh process, as a user's command
# does: a Ray started inside the long-lived pytest process can meet the Ray settings other tests left behind.
QUICK = ROOT / "results" / "quick"
REPLICATE_SAMPLE = """
from stabench.suite import replicate
rep = replicate.plan(QUICK, ("entropy-collapse", "degenerate-comparisons"), "0-1", methods=("baseline",))
assert len(rep.trials) == 4, rep.trials
for check in replicate.compare(rep, replicate.run(rep, cpus=2)):
    print(("OK " if check.ok else "MISMATCH ") + check.line)
"""


def test_a_sample_of_the_committed_quick_tier_replicates_within_the_tolerance():
    code = f"from pathlib import Path\nQUICK = Path({str(QUICK)!r})\n{REPLICATE_SAMPLE}"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    print(f"replicated 4 trials of {QUICK} in {time.monotonic() - started:.0f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("OK ", "MISMATCH "))]
    print("\n".join(lines))
    assert len(lines) == 2 and all(line.startswith("OK ") for line in lines), proc.stdout
