"""Re-run trials from the current code and compare them with a committed run's rows, column by column.

    python bench/same_rows.py results/quick entropy-collapse:baseline:0 entropy-collapse:kl-anchor:3 ...
    python bench/same_rows.py results/quick --sample 2      # two (method, seed) trials of every task in DIR
    python bench/same_rows.py REF --all                     # every trial of REF, a folder of *.parquet tables

REF is a run folder (`metrics.parquet`) or any folder of tidy tables, for example rows an earlier commit made on
this machine (rows made on another CPU's kernel set need not be equal to the bit).

A change that claims to move no number is checked this way: every numeric column of every row (both variants,
every iteration) must be equal, NaN where the committed row has NaN. Prints one line per trial; exits 1 if any
differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from stabench.suite.trial import TrialSpec, run_trial

KEYS = ["task", "method", "seed", "variant", "iteration"]


def compare(table: pd.DataFrame, task: str, method: str, seed: int, tier: str,
            detectors: tuple[str, ...]) -> tuple[bool, str]:  # fmt: skip
    old = table[(table["task"] == task) & (table["method"] == method) & (table["seed"] == seed)]
    old = old[old["cell"].fillna("") == ""] if "cell" in old else old
    if old.empty:
        return False, "no committed rows"
    task_ref = str(old["task_ref"].iloc[0])
    method_ref = str(old["method_ref"].iloc[0]) if "method_ref" in old else method
    new = run_trial(TrialSpec(task_ref, method_ref, seed, tier, detectors))
    old = old.sort_values(KEYS).reset_index(drop=True)
    new = new.sort_values(KEYS).reset_index(drop=True)
    if len(old) != len(new):
        return False, f"{len(new)} rows against {len(old)}"
    columns = [c for c in old.columns if pd.api.types.is_numeric_dtype(old[c]) and not old[c].isna().all()]
    missing = [c for c in columns if c not in new and c != "acts"]  # acts: the runner adds it
    columns = [c for c in columns if c in new]
    if missing:
        return False, f"columns missing: {missing}"
    bad = []
    for column in columns:
        a, b = old[column].to_numpy(dtype=float), new[column].to_numpy(dtype=float)
        if not np.array_equal(a, b, equal_nan=True):
            bad.append(f"{column} (max |diff| {np.nanmax(np.abs(a - b)):.3g})")
    if bad:
        return False, "differs: " + ", ".join(bad[:6])
    return True, f"{len(old)} rows x {len(columns)} numeric columns identical"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("trials", nargs="*", help="task:method:seed")
    parser.add_argument("--sample", type=int, default=0, help="this many (method, seed) trials of every task")
    parser.add_argument("--all", action="store_true", help="every trial in the folder")
    parser.add_argument("--tasks", default="", help="only these tasks (comma-separated)")
    args = parser.parse_args()
    table = pd.concat([pd.read_parquet(p) for p in sorted(args.folder.glob("*.parquet"))], ignore_index=True)
    if args.tasks:
        table = table[table["task"].isin(args.tasks.split(","))]
    manifest = args.folder / "manifest.json"
    tier = json.loads(manifest.read_text())["spec"]["tier"] if manifest.is_file() else str(table["tier"].iloc[0])
    detectors = tuple(c.split("/", 1)[1] for c in table.columns if c.startswith("alarm/"))
    wanted = [(t, m, int(s)) for t, m, s in (item.rsplit(":", 2) for item in args.trials)]
    if args.all:
        runs = table[["task", "method", "seed"]].drop_duplicates()
        wanted += [(t, m, int(s)) for t, m, s in runs.itertuples(index=False)]
    if args.sample:
        runs = table[table["status"] == "ok"][["task", "method", "seed"]].drop_duplicates()
        for task, rows in runs.groupby("task", sort=True):
            picked = rows.sample(min(args.sample, len(rows)), random_state=0)
            wanted += [(task, m, int(s)) for m, s in zip(picked["method"], picked["seed"])]
    failed = 0
    for task, method, seed in wanted:
        ok, what = compare(table, task, method, seed, tier, detectors)
        failed += not ok
        print(f"{'same' if ok else 'DIFF'}  {task}:{method}:{seed}  {what}", flush=True)
    print(f"{len(wanted) - failed} of {len(wanted)} trials identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
