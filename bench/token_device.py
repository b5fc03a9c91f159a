"""The token family's quick tier with the tasks placed on a chosen device: wall time, CPU vs GPU.

    python bench/token_device.py --device cpu --workers 2
    python bench/token_device.py --device cuda --workers 8     # on a machine with a GPU

Runs every (task, method, seed) trial of the token family (families `reasoning` and `tools`) exactly as a
sweep would (`suite.trial.run_trial`), but in a process pool instead of Ray Tune, so it needs neither Ray
nor MiniGrid on the GPU machine. With `--device cuda` each worker makes CUDA the default device before the
task builds its models, so the policy, reference, critics and batches live on the GPU. Prints one line per
task (trials, summed trial seconds, failures) and the total wall time; `--out FILE.csv` keeps per-trial rows.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_DEVICE = "cpu"


def _init(device: str) -> None:
    global _DEVICE
    import torch

    _DEVICE = device
    torch.set_num_threads(1)
    if device != "cpu":
        torch.set_default_device(device)


def _one(task: str, method: str, seed: int, tier: str) -> dict:
    from stabench.suite.trial import TrialSpec, run_trial

    start = time.perf_counter()
    table = run_trial(TrialSpec(task, method, seed, tier))
    status = ",".join(sorted(set(table["status"])))
    error = next((e for e in table["error"] if e), "")
    return {"task": task, "method": method, "seed": seed, "device": _DEVICE, "status": status,
            "seconds": round(time.perf_counter() - start, 3), "rows": len(table), "error": error[:200]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:0 ...")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tier", default="quick")
    parser.add_argument("--tasks", help="comma-separated task ids (default: the token family, experimental included)")
    parser.add_argument("--out", help="a CSV of per-trial rows")
    args = parser.parse_args()

    from stabench.suite import registry

    names = args.tasks.split(",") if args.tasks else [
        n for n in registry.names("task") if registry.get_task(n).family in ("reasoning", "tools")]
    trials = []
    for name in names:
        task = registry.get_task(name)
        trials += [(name, m, s, args.tier) for m in task.methods for s in range(task.budget(args.tier).seeds)]
    print(f"{len(trials)} trials of {len(names)} tasks on {args.device} with {args.workers} workers", flush=True)
    start, rows = time.perf_counter(), []
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=_init, initargs=(args.device,)) as pool:
        for fut in as_completed([pool.submit(_one, *t) for t in trials]):
            rows.append(fut.result())
    wall = time.perf_counter() - start
    per_task: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        per_task[row["task"]].append(row)
    for name, task_rows in per_task.items():
        bad = [r for r in task_rows if r["status"] != "ok"]
        print(f"{name:<20} {len(task_rows):>3} trials, {sum(r['seconds'] for r in task_rows):7.1f} trial-s, "
              f"{len(bad)} not ok{': ' + bad[0]['error'] if bad else ''}")
    print(f"total: {len(rows)} trials in {wall:.1f} s wall on {args.device} ({args.workers} workers)")
    if args.out:
        with open(args.out, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
