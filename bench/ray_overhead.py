"""Ray Tune's overhead against a plain process pool running the very same trials.

    python bench/ray_overhead.py                      # quick tier, the 4 default tasks' baselines, 2 seeds
    python bench/ray_overhead.py --tasks parallel-staleness --methods baseline,vtrace --seeds 4 --workers 2
    python bench/ray_overhead.py --methods default --seeds 5 --turns ray,pool --no-prime   # the quick tier itself
    python bench/ray_overhead.py --scaling 1,2,4,8,16  # the sweep through Ray at each worker count (a big machine)

Both sides run the same `TrialSpec` list with the same number of workers, one CPU and one torch thread per
trial: Ray through the suite's own runner (`stabench run`: a private local Ray, Tune's grid, checkpoints,
the collected table), the pool through `concurrent.futures.ProcessPoolExecutor` calling
`stabench.suite.trial.run_trial` and concatenating the rows in memory. Throughput is trials per second of
wall time, Ray's start-up included (it is part of what a user waits for). The two are run in ABBA order after
one untimed priming run of each (warm-start cache and file cache filled). Target: Ray's throughput at least
0.9 of the pool's on the quick tier.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor


def _trial(spec_fields: dict) -> int:
    from stabench.suite.trial import TrialSpec, run_trial

    return len(run_trial(TrialSpec(**spec_fields)))


def pool_run(specs: list, workers: int) -> float:
    from dataclasses import asdict

    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        rows = sum(pool.map(_trial, [asdict(s) for s in specs]))
    assert rows > 0
    return time.perf_counter() - start


def ray_run(argv: list[str], workers: int, out: str) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "stabench.suite.cli", "run", *argv, "--cpus", str(workers), "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", default="quick")
    parser.add_argument("--tasks", default="entropy-collapse,kl-estimator-bias,reward-hacking,parallel-staleness")
    parser.add_argument("--methods", default="baseline", help="comma-separated, or `default`: each task's own")
    parser.add_argument("--turns", default="ray,pool,pool,ray", help="the order of the timed runs (one block)")
    parser.add_argument("--no-prime", action="store_true", help="skip the priming runs; use the usual warm-start cache")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="ABBA blocks")
    parser.add_argument("--matrix", action="store_true", help="every registered stabilizer (then --methods is ignored)")
    parser.add_argument("--scaling", help="comma-separated worker counts: Ray only, wall and speed-up over the first")
    args = parser.parse_args()

    from stabench.suite.runner import ExperimentSpec

    tasks = tuple(args.tasks.split(","))
    methods = None if args.matrix or args.methods == "default" else tuple(args.methods.split(","))
    spec = ExperimentSpec(tier=args.tier, tasks=tasks, methods=methods, seeds=args.seeds, matrix=args.matrix)
    specs = spec.trials()
    argv = ["--tier", args.tier, "--tasks", args.tasks, "--seeds", str(args.seeds)]
    argv += ["--matrix"] if args.matrix else [] if methods is None else ["--methods", args.methods]
    print(f"{len(specs)} trials ({args.tier} tier; {args.tasks}; {'matrix' if args.matrix else args.methods}; "
          f"{args.seeds} seeds)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_prime:
            os.environ["STABENCH_CACHE"] = f"{tmp}/cache"
        if args.scaling:
            counts = [int(c) for c in args.scaling.split(",")]
            ray_run(argv, counts[-1], f"{tmp}/prime")
            walls = {c: ray_run(argv, c, f"{tmp}/ray-{c}") for c in counts}
            for c, wall in walls.items():
                print(f"Ray, {c:2d} workers: {wall:7.1f} s, {len(specs) / wall:.2f} trials/s, "
                      f"speed-up {walls[counts[0]] / wall:.2f}x over {counts[0]}", flush=True)
            return
        if not args.no_prime:
            print(f"priming (untimed): pool {pool_run(specs, args.workers):.1f} s, "
                  f"Ray {ray_run(argv, args.workers, f'{tmp}/prime'):.1f} s", flush=True)
        times: dict[str, list[float]] = {"ray": [], "pool": []}
        for i, side in enumerate(args.turns.split(",") * args.repeats):
            wall = ray_run(argv, args.workers, f"{tmp}/ray{i}") if side == "ray" else pool_run(specs, args.workers)
            times[side].append(wall)
            print(f"{side:4s}: {wall:6.1f} s, {len(specs) / wall:.3f} trials/s", flush=True)
    ray, pool = statistics.mean(times["ray"]), statistics.mean(times["pool"])
    print(f"mean wall: Ray {ray:.1f} s, pool {pool:.1f} s; Ray's throughput / the pool's = {pool / ray:.3f} "
          f"(target >= 0.9)")


if __name__ == "__main__":
    main()
