"""Reliability of sweeps: SIGKILL and resume, identical tables across worker counts, retried workers."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import TOY

pytestmark = pytest.mark.smoke

SLOW = [f"{TOY}:SlowToyTask"]
GRID = ["--tier", "smoke", "--tasks", *SLOW, "--methods", f"baseline,{TOY}:ToyFix", "--seeds", "6"]


def stabench(*argv, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "stabench.suite.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


def kill_after(finished: int, out: Path, log: Path) -> None:
    """Start the sweep, SIGKILL its whole process group once `finished` trials have reported."""
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "stabench.suite.cli", "run", *GRID, "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if log.read_text().count(" seed=") >= finished:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the sweep ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    proc = stabench("run", *GRID, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return pd.read_parquet(out / "metrics.parquet")


@pytest.mark.parametrize("finished", [1, 5, 9])
def test_a_sweep_killed_with_sigkill_resumes_to_the_same_table(uninterrupted, tmp_path, finished):
    out = tmp_path / "run"
    kill_after(finished, out, tmp_path / "killed.log")
    assert not (out / "metrics.parquet").exists()
    proc = stabench("run", *GRID, "--out", str(out), "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = re.search(r"stabench: resuming, (\d+) of 12 trials already finished", proc.stderr)
    assert resumed, proc.stderr[-2000:]
    done = int(resumed.group(1))
    assert finished <= done <= 12  # every trial seen finishing before the kill kept its rows
    # the resumed sweep ran at least every unfinished trial (Tune may rerun one that finished after its last save)
    assert 12 - done <= proc.stderr.count(" seed=") <= 12
    table = pd.read_parquet(out / "metrics.parquet")
    assert not table.duplicated(["task", "method", "seed", "variant", "iteration"]).any()  # none run twice
    pd.testing.assert_frame_equal(uninterrupted, table)  # none lost, same numbers
    trials = pd.read_csv(out / "trials.csv")
    assert (trials.status == "ok").all() and len(trials) == 12


def test_one_and_two_workers_give_identical_tables(tmp_path):
    argv = ["--tier", "smoke", "--tasks", "dead-layers,kl-estimator-bias", "--methods", "baseline", "--seeds", "2"]
    tables = []
    for cpus in ("1", "2"):
        out = tmp_path / f"cpus{cpus}"
        proc = stabench("run", *argv, "--cpus", cpus, "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"with {cpus} CPUs" in proc.stderr
        tables.append(pd.read_parquet(out / "metrics.parquet"))
    pd.testing.assert_frame_equal(tables[0], tables[1])


def test_a_trial_whose_worker_dies_is_retried_and_the_retry_is_recorded(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "STABENCH_TEST_MARKER": str(tmp_path / "died")}
    proc = stabench("run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask", "--methods", f"{TOY}:DieOnce",
                    "--seeds", "1", "--out", str(out), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "died").exists() and "[retry] toy die-once seed=0" in proc.stderr
    trials = pd.read_csv(out / "trials.csv")
    assert trials.loc[0, "status"] == "ok" and trials.loc[0, "retries"] == 1
    assert len(pd.read_parquet(out / "metrics.parquet")) == 2 * 12
