"""Sweeps through Ray Tune: the real tasks' smoke tier on the embedded local Ray, resume, and a cluster."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import TOY

from suite import registry

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]
STABILIZER = f"{ROOT}/examples/my_stabilizer.py:AdvantageClip"
DETECTOR = f"{ROOT}/examples/my_detector.py:JumpDetector"
TASKS = tuple(n for n in registry.names("task") if not registry.get_task(n).experimental)


def stabench(*argv, timeout=900):
    return subprocess.run([sys.executable, "-m", "suite.cli", *argv], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory):
    """The README's walk-through on the smoke tier: the default suite plus the two example plugins."""
    out = tmp_path_factory.mktemp("sweep") / "run"
    proc = stabench("run", "--tier", "smoke", "--seeds", "2", "--stabilizer", STABILIZER, "--detector", DETECTOR,
                    "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def methods_of(task) -> set[str]:
    extra = {"advantage-clip"} if registry.make_stabilizer(STABILIZER).applies_to(task.trainer) else set()
    return set(task.methods) | extra


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


def test_resume_of_a_finished_sweep_reruns_nothing_and_keeps_the_table(smoke_sweep):
    out, _ = smoke_sweep
    before = pd.read_parquet(out / "metrics.parquet")
    proc = stabench("run", "--tier", "smoke", "--seeds", "2", "--stabilizer", STABILIZER, "--detector", DETECTOR,
                    "--out", str(out), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stderr
    pd.testing.assert_frame_equal(before, pd.read_parquet(out / "metrics.parquet"))
    other = stabench("run", "--tier", "smoke", "--tasks", TASKS[0], "--out", str(out), "--resume")
    assert other.returncode == 2 and "holds a different experiment" in other.stderr


def test_walkthrough_score_submit_verify_leaderboard(smoke_sweep, tmp_path):
    out, _ = smoke_sweep
    proc = stabench("score", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "advantage-clip" in proc.stdout and "jump" in proc.stdout and "matched-fix" in proc.stdout
    board = tmp_path / "leaderboard.csv"
    proc = stabench("submit", str(out), "--method", "advantage-clip", "--detector", "jump", "--leaderboard", str(board))
    assert proc.returncode == 0, proc.stderr
    rows = pd.read_csv(board)
    assert list(rows.name) == ["advantage-clip", "jump"] and list(rows.track) == ["stabilizer", "detector"]
    assert (rows.tier == "smoke").all() and (rows.n_seeds == 2).all()
    assert (tmp_path / "LEADERBOARD.md").read_text().count("advantage-clip") == 1
    before = board.read_bytes()
    again = stabench("submit", str(out), "--method", "advantage-clip", "--leaderboard", str(board))
    assert again.returncode == 2 and "duplicate" in again.stderr and board.read_bytes() == before
    check = stabench("verify", str(out), "--leaderboard", str(board))
    assert check.returncode == 0 and "0 mismatches" in check.stdout, check.stdout + check.stderr
    shown = stabench("leaderboard", "--leaderboard", str(board))
    assert shown.returncode == 0 and "advantage-clip" in shown.stdout


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
        assert len(table) == 2 * registry.get_task(f"{TOY}:ToyTask").budget("smoke").iterations
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
