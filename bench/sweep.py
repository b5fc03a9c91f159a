"""Sweep benchmarks through Ray Tune: scaling from 1 to 2 worker CPUs, the quick tier's wall time, memory.

    python bench/sweep.py scaling   # the smoke grid (default suite, 2 seeds), --cpus 1 vs 2, ABBA order
    python bench/sweep.py scaling --sweep "--tier quick --tasks parallel-staleness"  # a compute-bound sweep
    python bench/sweep.py quick     # the whole quick tier, wall time and peak memory of the sweep
    python bench/sweep.py trial     # peak resident memory of one quick-tier trial per task, in-process

Peak memory of a sweep is the largest sum of resident memory over the `stabench` process and all its
descendants (Ray's processes and workers included), sampled every 0.5 s with psutil.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def watched(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int]:
    """Run a command; return (wall seconds, peak resident GiB of its process tree, exit status)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.5)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode:
        print(err[-2000:], file=sys.stderr)
    return time.perf_counter() - start, peak / 2**30, proc.returncode


def stabench(*args: str) -> list[str]:
    return [sys.executable, "-m", "stabench.suite.cli", *args]


def scaling(repeats: int, extra: list[str]) -> None:
    """The smoke grid (or the sweep `extra` names) with 1 and 2 worker CPUs, in ABBA order after one untimed
    priming run.

    The priming run fills a fresh warm-start cache (`STABENCH_CACHE`) and the OS's file cache, as any
    earlier sweep on the machine would have; without it the first timed run would pay both alone.
    """
    times: dict[str, list[float]] = {"1": [], "2": []}
    order = ["1", "2", "2", "1"] * repeats
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "STABENCH_CACHE": f"{tmp}/cache"}
        sweep = ["run", *(extra or ["--tier", "smoke", "--seeds", "2"])]
        wall, _, rc = watched(stabench(*sweep, "--cpus", "2", "--out", f"{tmp}/prime"), env)
        print(f"priming run (untimed): {wall:.1f} s, exit {rc}", flush=True)
        for i, cpus in enumerate(order):
            wall, peak, rc = watched(stabench(*sweep, "--cpus", cpus, "--out", f"{tmp}/run{i}"), env)
            times[cpus].append(wall)
            print(f"{' '.join(sweep[1:])}, {cpus} worker CPU(s): {wall:.1f} s wall, peak {peak:.2f} GiB, exit {rc}",
                  flush=True)
    one, two = statistics.mean(times["1"]), statistics.mean(times["2"])
    print(f"mean of {len(times['1'])} runs each: {one:.1f} s vs {two:.1f} s; speed-up 1 -> 2 CPUs: {one / two:.2f}x "
          f"(target >= 1.7x)")


def quick() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wall, peak, rc = watched(stabench("run", "--tier", "quick", "--out", f"{tmp}/quick"))
        print(f"quick tier: {wall / 60:.1f} min wall (target <= 12), peak {peak:.2f} GiB (target < 6), exit {rc}")
        print(Path(f"{tmp}/quick/trials.csv").read_text().count("\n") - 1, "trials")


def trial() -> None:
    from stabench.suite import registry
    from stabench.suite.runner import TrialSpec, run_trial

    for name in registry.names("task"):
        start = time.perf_counter()
        run_trial(TrialSpec(name, "baseline", 0, "quick"))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"{name}: one quick trial {time.perf_counter() - start:.1f} s; peak resident memory of this "
              f"process so far {peak:.2f} GiB", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["scaling", "quick", "trial"])
    parser.add_argument("--repeats", type=int, default=1, help="scaling: ABBA blocks of timed runs (default: 1)")
    parser.add_argument("--sweep", default="", help="scaling: `stabench run` options in place of the smoke grid's "
                        "(for example \"--tier quick --tasks parallel-staleness\")")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.what == "scaling":
        scaling(args.repeats, args.sweep.split())
    else:
        {"quick": quick, "trial": trial}[args.what]()
