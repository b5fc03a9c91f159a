"""Sweeps through Ray Tune: the real tasks' smoke tier on the embedded local Ray, resume, and a cluster."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import registry
from stabench.suite.api import REFERENCE_METHODS

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]
STABILIZER = f"{ROOT}/examples/my_stabilizer.py:SpikeSkip"
DETECTOR = f"{ROOT}/examples/my_detector.py:JumpDetector"
TASKS = tuple(n for n in registry.names("task") if not registry.get_task(n).experimental)


def stabench(*argv, timeout=900):
    return subprocess.run([sys.executable, "-m", "stabench.suite.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory):
    """The README's walk-through on the smoke tier: the default suite plus the two example plugins."""
    out = tmp_path_factory.mktemp("sweep") / "run"
    proc = stabench("run", "--tier", "smoke", "--seeds", "2", "--stabilizer", STABILIZER, "--detector", DETECTOR,
                    "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def folder_digest(folder: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def methods_of(task) -> set[str]:
    extra = {"spike-skip"} if registry.make_stabilizer(STABILIZER).applies_to(task) else set()
    return set(task.default_methods()) | extra  # baseline, matched fix and both references


def test_smoke_sweep_writes_one_tidy_row_per_trial_iteration(smoke_sweep):
    out, proc = smoke_sweep
    table = pd.read_parquet(out / "metrics.parquet")
    for column in ("task", "method", "role", "variant", "seed", "iteration", "step", "return", "entropy",
                   "phase", "status", "alarm/threshold", "alarm/cusum", "alarm/jump", "suite_version",
                   "task_version", "config_hash"):
        assert column in table, column
    assert set(table.task) == {registry.get_task(t).id for t in TASKS}
    for task_id in TASKS:
        task = registry.get_task(task_id)
        budget = task.budget("smoke")
        rows = table[table.task == task.id]
        assert set(rows.method) == methods_of(task)
        assert len(rows) == len(methods_of(task)) * 2 * 2 * budget.iterations  # methods x seeds x variants x its
        assert task.ground_truth.metric in rows
        columns = {"grad_norms": "grad_norm_total", "kl_estimators": "kl_k3", "dormant": "dormant_share"}
        for diagnostic, column in columns.items():
            if diagnostic in task.diagnostics:
                assert rows[column].notna().any(), column
        assert rows.entropy.notna().all()
    trials = pd.read_csv(out / "trials.csv")
    assert len(trials) == sum(len(methods_of(registry.get_task(t))) * 2 for t in TASKS)
    assert (trials.status == "ok").all(), trials[trials.status != "ok"]
    assert "trials on a private local Ray" in proc.stderr and f"{len(trials)}/{len(trials)}]" in proc.stderr
    # Tune's own per-trial log files stay off in a sweep (`runner.without_tune_logfiles`); the checkpoints are there
    tune_files = {p.name for p in (out / "tune").rglob("*") if p.is_file()}
    assert "rows.parquet" in tune_files and not tune_files & {"result.json", "progress.csv", "params.json"}
    assert not any(name.startswith("events.out.tfevents") for name in tune_files)
    assert "Failed to fetch metrics" not in proc.stderr  # Tune's note that those files are missing is not shown


def test_resume_of_a_finished_sweep_reruns_nothing_and_keeps_the_table(smoke_sweep):
    out, _ = smoke_sweep
    before = pd.read_parquet(out / "metrics.parquet")
    proc = stabench("run", "--tier", "smoke", "--seeds", "2", "--stabilizer", STABILIZER, "--detector", DETECTOR,
                    "--out", str(out), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stderr
    pd.testing.assert_frame_equal(before, pd.read_parquet(out / "metrics.parquet"))
    before_files = folder_digest(out)
    other = stabench("run", "--tier", "smoke", "--tasks", TASKS[0], "--out", str(out), "--resume")
    assert other.returncode == 2 and "holds a different experiment" in other.stderr
    assert folder_digest(out) == before_files  # the refused request changed nothing in the result folder


def test_walkthrough_score_submit_verify_leaderboard(smoke_sweep, tmp_path):
    out, _ = smoke_sweep
    proc = stabench("score", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "spike-skip" in proc.stdout and "jump" in proc.stdout and "matched-fix" in proc.stdout
    board = tmp_path / "leaderboard.csv"
    proc = stabench("submit", str(out), "--method", "spike-skip", "--detector", "jump", "--leaderboard", str(board))
    assert proc.returncode == 0, proc.stderr
    rows = pd.read_csv(board)
    assert list(rows.name) == ["spike-skip", "jump"] and list(rows.track) == ["stabilizer", "detector"]
    assert (rows.tier == "smoke").all() and (rows.n_seeds == 2).all()
    assert (tmp_path / "LEADERBOARD.md").read_text().count("spike-skip") == 1
    before = board.read_bytes()
    again = stabench("submit", str(out), "--method", "spike-skip", "--leaderboard", str(board))
    assert again.returncode == 2 and "duplicate" in again.stderr and board.read_bytes() == before
    check = stabench("verify", str(out), "--leaderboard", str(board))
    assert check.returncode == 0 and "0 mismatches" in check.stdout, check.stdout + check.stderr
    shown = stabench("leaderboard", "--leaderboard", str(board))
    assert shown.returncode == 0 and "spike-skip" in shown.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.cluster
def test_run_on_a_ray_cluster_started_with_ray_start_head(tmp_path):
    port = _free_port()
    temp = Path(f"/tmp/sbc{os.getpid()}")
    ray_bin = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
         f"--temp-dir={temp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        out = tmp_path / "run"
        proc = stabench("run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask", "--seeds", "1", "--out", str(out),
                        "--address", f"127.0.0.1:{port}", timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"the Ray cluster at 127.0.0.1:{port} with 1 CPUs" in proc.stderr
        table = pd.read_parquet(out / "metrics.parquet")
        methods = 1 + len(REFERENCE_METHODS)  # the toy's baseline and both references
        assert len(table) == 2 * methods * registry.get_task(f"{TOY}:ToyTask").budget("smoke").iterations
    finally:
        # end only what this test started: the head's process group, then any of its daemons by pid
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        for proc_dir in Path("/proc").iterdir():
            if proc_dir.name.isdigit():
                try:
                    if str(temp).encode() in (proc_dir / "cmdline").read_bytes():
                        os.kill(int(proc_dir.name), signal.SIGKILL)
                except OSError:
                    pass
        subprocess.run(["rm", "-rf", str(temp)], check=False)


def cli(capsys, *argv) -> tuple[int, str, str]:
    """The CLI in this process (the leaderboard commands start no Ray, so this is safe and fast)."""
    from stabench.suite.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _copy_run(out: Path, dest: Path) -> Path:
    dest.mkdir()
    for name in ("metrics.parquet", "manifest.json", "trials.csv"):
        (dest / name).write_bytes((out / name).read_bytes())
    return dest


def _spoil(kind: str, run: Path) -> None:
    import json

    if kind == "incomplete grid":
        table = pd.read_parquet(run / "metrics.parquet")
        table[table.task != table.task.iloc[0]].to_parquet(run / "metrics.parquet")
    elif kind == "wrong version":
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["suite_version"] = "0.0.1"
        (run / "manifest.json").write_text(json.dumps(manifest))
    elif kind == "lost trial":
        trials = pd.read_csv(run / "trials.csv")
        trials.loc[0, "status"] = "error"
        trials.to_csv(run / "trials.csv", index=False)
    elif kind == "missing iterations":
        table = pd.read_parquet(run / "metrics.parquet")
        table.drop(index=table.index[3]).to_parquet(run / "metrics.parquet")
    elif kind == "not a run":
        (run / "trials.csv").unlink()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("incomplete grid", "incomplete grid for tier smoke"),
        ("wrong version", "made by suite version 0.0.1"),
        ("lost trial", "trials did not finish"),
        ("missing iterations", "iterations are missing"),
        ("not a run", "is not a finished run: trials.csv is missing"),
    ],
)
def test_bad_submissions_leave_the_leaderboard_byte_identical(smoke_sweep, tmp_path, capsys, kind, message):
    out, _ = smoke_sweep
    board = tmp_path / "leaderboard.csv"
    assert cli(capsys, "submit", str(out), "--detector", "never", "--leaderboard", str(board))[0] == 0
    before = board.read_bytes()
    run = _copy_run(out, tmp_path / "bad")
    _spoil(kind, run)
    code, _, err = cli(capsys, "submit", str(run), "--leaderboard", str(board))
    assert code == 2 and message in err, err
    assert err.count("\n") == 1
    assert board.read_bytes() == before


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda text: text.replace(",never,", ",nevermind,", 1), "tampered row: line 2 (detector nevermind)"),
        (lambda text: text[: len(text) // 2], "is corrupt"),
        (lambda text: "name,score\nx,1\n", "is corrupt: its header is not the leaderboard's"),
    ],
)
def test_a_corrupt_or_tampered_leaderboard_refuses_submissions(smoke_sweep, tmp_path, capsys, edit, message):
    out, _ = smoke_sweep
    board = tmp_path / "leaderboard.csv"
    assert cli(capsys, "submit", str(out), "--detector", "never", "--leaderboard", str(board))[0] == 0
    board.write_text(edit(board.read_text()))
    before = board.read_bytes()
    code, _, err = cli(capsys, "submit", str(out), "--detector", "always", "--leaderboard", str(board))
    assert code == 2 and message in err, err
    assert board.read_bytes() == before
    code, _, err = cli(capsys, "verify", "--leaderboard", str(board))
    assert code == 2 and message in err


def test_eight_concurrent_submissions_all_land(smoke_sweep, tmp_path):
    out, _ = smoke_sweep
    board = tmp_path / "leaderboard.csv"
    detectors = ["threshold", "calibrated-threshold", "cusum", "page-hinkley", "never", "always", "random", "jump"]
    procs = [
        subprocess.Popen([sys.executable, "-m", "stabench.suite.cli", "submit", str(out), "--detector", d,
                          "--leaderboard", str(board)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for d in detectors
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    rows = pd.read_csv(board)
    assert sorted(rows.name) == sorted(detectors)
    assert stabench("verify", str(out), "--leaderboard", str(board)).returncode == 0


def test_extend_adds_only_the_missing_tasks_and_equals_one_whole_run(tmp_path):
    first, second = "entropy-collapse", "degenerate-comparisons"
    common = ("run", "--tier", "smoke", "--seeds", "1", "--cpus", "1")
    grown, whole = tmp_path / "grown", tmp_path / "whole"
    assert stabench(*common, "--tasks", first, "--out", str(grown)).returncode == 0
    # as if `no-update` had been registered after the folder was made: the extension must run it on the kept task
    rows, trials = pd.read_parquet(grown / "metrics.parquet"), pd.read_csv(grown / "trials.csv")
    rows[rows.method != "no-update"].to_parquet(grown / "metrics.parquet", index=False)
    trials[trials.method != "no-update"].to_csv(grown / "trials.csv", index=False)
    proc = stabench(*common, "--tasks", f"{first},{second}", "--out", str(grown), "--extend")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(adding {second})" in proc.stderr and f"{first} no-update" in proc.stderr
    assert f"{first} baseline" not in proc.stderr  # the kept trials did not run again
    assert stabench(*common, "--tasks", f"{first},{second}", "--out", str(whole)).returncode == 0
    pd.testing.assert_frame_equal(pd.read_parquet(grown / "metrics.parquet"),
                                  pd.read_parquet(whole / "metrics.parquet"))
    pd.testing.assert_frame_equal(pd.read_csv(grown / "trials.csv").drop(columns="seconds"),
                                  pd.read_csv(whole / "trials.csv").drop(columns="seconds"))
    grown_manifest, whole_manifest = (json.loads((d / "manifest.json").read_text()) for d in (grown, whole))
    assert grown_manifest["config_hash"] == whole_manifest["config_hash"]
    assert [s["tasks"] for s in grown_manifest["sessions"]] == [[first], [second]]
    before = folder_digest(grown)
    for extra, message in ((("--tasks", f"{first},{second}"), "nothing to add"),
                           (("--tasks", second), f"name {first} too"),
                           (("--tasks", f"{first},{second},hard-sample-shortcuts", "--seed-start", "3"), "seed_start")):
        refused = stabench(*common, *extra, "--out", str(grown), "--extend")
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr[-2000:]
    assert folder_digest(grown) == before  # a refused extension changes nothing
    # a method registered since and no new task: the extension runs that method's trials on the kept tasks only
    rows, trials = pd.read_parquet(grown / "metrics.parquet"), pd.read_csv(grown / "trials.csv")
    rows[rows.method != "no-update"].to_parquet(grown / "metrics.parquet", index=False)
    trials[trials.method != "no-update"].to_csv(grown / "trials.csv", index=False)
    proc = stabench(*common, "--tasks", f"{first},{second}", "--out", str(grown), "--extend")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{second} no-update" in proc.stderr and f"{second} baseline" not in proc.stderr
    pd.testing.assert_frame_equal(pd.read_parquet(grown / "metrics.parquet"),
                                  pd.read_parquet(whole / "metrics.parquet"))
    pd.testing.assert_frame_equal(pd.read_csv(grown / "trials.csv").drop(columns="seconds"),
                                  pd.read_csv(whole / "trials.csv").drop(columns="seconds"))
    last = json.loads((grown / "manifest.json").read_text())["sessions"][-1]
    assert last["tasks"] == [] and last["methods"] == ["no-update"]
    trials = pd.read_csv(grown / "trials.csv")  # a trial of a method the registry no longer holds
    pd.concat([trials, trials.head(1).assign(method="retired")]).to_csv(grown / "trials.csv", index=False)
    refused = stabench(*common, "--tasks", f"{first},{second},hard-sample-shortcuts", "--out", str(grown), "--extend")
    assert refused.returncode == 2 and "no longer plans" in refused.stderr, refused.stderr[-2000:]


def test_extend_replace_runs_a_changed_task_again_and_keeps_the_others(tmp_path):
    first, second = "entropy-collapse", "degenerate-comparisons"
    common = ("run", "--tier", "smoke", "--seeds", "1", "--cpus", "1", "--tasks", f"{first},{second}")
    out, whole = tmp_path / "out", tmp_path / "whole"
    assert stabench(*common, "--out", str(whole)).returncode == 0
    shutil.copytree(whole, out)
    rows = pd.read_parquet(out / "metrics.parquet")  # as if the first task's rows came from an older version
    rows.loc[rows.task == first, "return"] = 999.0
    rows.to_parquet(out / "metrics.parquet", index=False)
    before = folder_digest(out)
    for extra, message in ((("--replace", first), "goes with --extend"),
                           (("--extend", "--replace", "hard-sample-shortcuts"), "does not hold"),
                           (("--extend", "--replace", first, "--replace", second), "rerun it whole")):
        refused = stabench(*common, "--out", str(out), *extra)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr[-2000:]
    assert folder_digest(out) == before  # a refused request changes nothing
    proc = stabench(*common, "--out", str(out), "--extend", "--replace", first)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{first} baseline" in proc.stderr and f"{second} baseline" not in proc.stderr  # only the stale task ran
    pd.testing.assert_frame_equal(pd.read_parquet(out / "metrics.parquet"), pd.read_parquet(whole / "metrics.parquet"))
    pd.testing.assert_frame_equal(pd.read_csv(out / "trials.csv").drop(columns="seconds"),
                                  pd.read_csv(whole / "trials.csv").drop(columns="seconds"))
    sessions = json.loads((out / "manifest.json").read_text())["sessions"]
    assert sessions[-1]["tasks"] == [first] and sessions[-1]["replaced"] == [first]


def test_extend_turns_the_runs_of_a_method_that_no_longer_acts_into_copies_of_the_baselines(tmp_path):
    """A method whose `needs` narrowed since the folder was made (the importance corrections once ran on tasks where
    the learner samples): the extension runs nothing, drops its runs there and copies the baseline's."""
    first, second = "entropy-collapse", "degenerate-comparisons"
    common = ("run", "--tier", "smoke", "--seeds", "1", "--cpus", "1", "--tasks", f"{first},{second}",
              "--methods", "baseline,token-tis")
    out, whole = tmp_path / "out", tmp_path / "whole"
    assert stabench(*common, "--out", str(whole)).returncode == 0
    shutil.copytree(whole, out)
    rows, trials = pd.read_parquet(out / "metrics.parquet"), pd.read_csv(out / "trials.csv")
    assert set(trials.loc[trials.method == "token-tis", "status"]) == {"identity"}
    mine = (rows.task == first) & (rows.method == "token-tis")  # as if it had acted there when the folder was made
    rows.loc[mine, "acts"], rows.loc[mine, "return"] = True, 999.0
    rows.to_parquet(out / "metrics.parquet", index=False)
    ran = (trials.task == first) & (trials.method == "token-tis")
    trials.loc[ran, "status"], trials.loc[ran, "seconds"] = "ok", 1.0
    trials.to_csv(out / "trials.csv", index=False)
    proc = stabench(*common, "--out", str(out), "--extend")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"token-tis no longer acts on {first}" in proc.stderr and f"token-tis no longer acts on {second}" \
        not in proc.stderr and "trials on" not in proc.stderr  # nothing ran: no Ray was started
    pd.testing.assert_frame_equal(pd.read_parquet(out / "metrics.parquet"), pd.read_parquet(whole / "metrics.parquet"))
    pd.testing.assert_frame_equal(pd.read_csv(out / "trials.csv").drop(columns="seconds"),
                                  pd.read_csv(whole / "trials.csv").drop(columns="seconds"))
    session = json.loads((out / "manifest.json").read_text())["sessions"][-1]
    assert session["narrowed"] == [f"{first} token-tis"] and session["tasks"] == [] and "methods" not in session
    refused = stabench(*common, "--out", str(out), "--extend")
    assert refused.returncode == 2 and "nothing to add" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.parametrize(("curves", "expected"), [(False, 0), (True, 3)])
def test_a_trial_reports_progress_sparsely_unless_its_curves_are_logged(monkeypatch, curves, expected):
    """Each report holds the trial until the driver has taken it: without `--wandb` a quick trial reports only
    at the end (at most one report per `PROGRESS_SECONDS`); with it, every sampled row is a point of its curves."""
    import pandas as pd
    from stabench.suite import runner

    reports = []

    def fake_run_trial(spec, on_progress):
        for it in range(3):
            on_progress(it, "injected", {"return": 0.5})
        return pd.DataFrame({"status": ["ok"], "return": [0.5]})

    monkeypatch.setattr(runner, "run_trial", fake_run_trial)
    monkeypatch.setattr(runner.tune, "report", lambda metrics, checkpoint=None: reports.append(metrics))
    trial = {"task": "entropy-collapse", "method": "baseline", "seed": 0, "tier": "smoke", "detectors": [],
             "knobs": []}
    runner._tune_trainable({"trial": trial, "curves": curves})
    progress = [r for r in reports if not r["done"]]
    assert len(progress) == expected and reports[-1]["done"] and reports[-1]["status"] == "ok"
