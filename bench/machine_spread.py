"""Between-machine spread against between-seed spread, per task (issue on comparable rows, item 2).

    python bench/machine_spread.py COMMITTED RERUN [--tasks a,b] [--seeds-from MATRIX]

COMMITTED holds rows made on one machine, RERUN the same trials (tasks, methods, seeds) made on another. Per task:
how many runs are bit-identical, the spread of the per-run difference of normalized return after onset (mean |d|,
SD of d), the between-seed SD (pooled over method and variant, from MATRIX's 10 seeds when given, else from
COMMITTED), their ratio (about 1.4 when a re-run moves like a fresh seed: the difference of two independent draws),
the failure verdicts of injected runs that flip, and per method the shift of its mean normalized return against the
shift of its gain over the same folder's baseline (the baseline's own path enters every gain).
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from stabench.suite.figures import markdown_table
from stabench.suite.outcomes import outcomes as run_outcomes


def outcomes(folder: str, tasks: list[str] | None) -> pd.DataFrame:
    table = pd.read_parquet(f"{folder}/metrics.parquet")
    if tasks:
        table = table[table["task"].isin(tasks)]
    runs = run_outcomes(table)
    return runs[runs["acts"]]


def spread(committed: pd.DataFrame, rerun: pd.DataFrame, seeds_from: pd.DataFrame) -> pd.DataFrame:
    keys = ["task", "method", "seed", "variant"]
    both = committed.merge(rerun, on=keys, suffixes=("_a", "_b"))
    both["d"] = both["normalized_return_b"] - both["normalized_return_a"]
    rows = []
    for task, g in both.groupby("task"):
        methods = set(g["method"])
        pool = seeds_from[(seeds_from["task"] == task) & seeds_from["method"].isin(methods)]
        seed_sd = float(np.sqrt(pool.groupby(["method", "variant"])["normalized_return"].var(ddof=1).mean()))
        injected = g[g["variant"] == "injected"]
        means = injected.groupby("method")[["normalized_return_a", "normalized_return_b"]].mean()
        gains = means - means.loc["baseline"]
        others = [m for m in means.index if m != "baseline"]
        rows.append({
            "task": task, "runs": len(g), "identical": int((g["d"] == 0).sum()),
            "machine mean abs(d)": g["d"].abs().mean(), "machine SD of d": g["d"].std(ddof=1),
            "seed SD": seed_sd, "ratio": g["d"].std(ddof=1) / seed_sd,
            "verdict flips": f"{int((injected['failed_a'] != injected['failed_b']).sum())}/{len(injected)}",
            "method shift": (means.loc[others, "normalized_return_b"] - means.loc[others, "normalized_return_a"])
            .abs().mean(),
            "gain shift": (gains.loc[others, "normalized_return_b"] - gains.loc[others, "normalized_return_a"])
            .abs().mean(),
        })
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("committed")
    parser.add_argument("rerun")
    parser.add_argument("--tasks", default="")
    parser.add_argument("--seeds-from", default="", help="a folder with more seeds for the between-seed SD")
    args = parser.parse_args()
    tasks = [t for t in args.tasks.split(",") if t] or None
    committed, rerun = outcomes(args.committed, tasks), outcomes(args.rerun, tasks)
    seeds_from = outcomes(args.seeds_from, tasks) if args.seeds_from else committed
    print(markdown_table(spread(committed, rerun, seeds_from)))


if __name__ == "__main__":
    main()
