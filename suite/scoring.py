"""Scores from the tidy table. Pure functions: a table in, numbers out.

Stabilizer track, per task and method:
- failure: a run fails when its task's ground truth crosses the threshold after onset (see
  `suite.api.GroundTruth`); a diverged run counts as failed.
- normalized return: the mean true return over the post-onset iterations, mapped through the task's
  fixed floor and ceiling, (R - floor) / (ceiling - floor). Iterations a diverged run never reached
  count at the floor. The 95% interval is a percentile bootstrap over seeds (scipy, fixed seed).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

from suite import registry
from suite.api import GroundTruth, Task

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def run_failed(rows: pd.DataFrame, gt: GroundTruth, onset: int, iterations: int) -> bool:
    """Whether one run (one task, method, seed and variant; rows in iteration order) failed."""
    if (rows["status"] == "diverged").any():
        return True
    if gt.metric not in rows:
        return False
    if gt.reduce == "any":
        values = rows.loc[rows["iteration"] >= onset, gt.metric].astype(float)
        crossed = values > gt.threshold if gt.fails_when == "above" else values < gt.threshold
        return bool(crossed.any())
    first = iterations - max(1, math.ceil(gt.tail * iterations))
    value = float(np.nanmean(rows.loc[rows["iteration"] >= first, gt.metric].astype(float)))
    if math.isnan(value):
        return True
    return value > gt.threshold if gt.fails_when == "above" else value < gt.threshold


def post_onset_return(rows: pd.DataFrame, task: Task, onset: int, iterations: int) -> float:
    """Mean true return after onset; iterations missing because the run diverged count at the floor."""
    stop = rows["diverged_at"].max() if "diverged_at" in rows else math.nan
    reached = rows[(rows["iteration"] >= onset) & ~(rows["iteration"] >= stop)]
    observed = reached["return"].astype(float).dropna()  # no episode ended: missing, not zero
    missing = (iterations - onset) - len(reached)  # iterations a diverged run never reached
    count = len(observed) + missing
    return float((observed.sum() + missing * task.return_floor) / count) if count else math.nan


def outcomes(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, method, seed, variant): failed, post-onset return, normalized return."""
    rows = []
    tasks: dict[str, Task] = {}
    for (task_id, method, seed, variant), run in table.groupby(["task", "method", "seed", "variant"], sort=True):
        ref = run["task_ref"].iloc[0] if "task_ref" in run else task_id
        task = tasks.setdefault(ref, registry.get_task(ref))
        run = run.sort_values("iteration")
        onset, iterations = int(run["onset_iteration"].iloc[0]), int(run["iterations"].iloc[0])
        ret = post_onset_return(run, task, onset, iterations)
        rows.append(
            {
                "task": task_id,
                "method": method,
                "role": run["role"].iloc[0],
                "seed": seed,
                "variant": variant,
                "failed": run_failed(run, task.ground_truth, onset, iterations),
                "diverged": bool((run["status"] == "diverged").any()),
                "post_onset_return": ret,
                "normalized_return": task.normalized_return(ret) if not math.isnan(ret) else math.nan,
            }
        )
    return pd.DataFrame(rows)


def bootstrap_mean_ci(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return math.nan, math.nan
    if len(values) == 1 or np.all(values == values[0]):
        return float(values[0]), float(values[0])
    res = stats.bootstrap(
        (values,),
        np.mean,
        confidence_level=confidence,
        n_resamples=BOOTSTRAP_RESAMPLES,
        method="percentile",
        rng=np.random.default_rng(BOOTSTRAP_SEED),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def stabilizer_track(table: pd.DataFrame) -> list[dict]:
    """Per task and method: failure rates, normalized return with its 95% interval, number of seeds."""
    out = []
    per_run = outcomes(table)
    for (task_id, method), group in per_run.groupby(["task", "method"], sort=True):
        injected = group[group["variant"] == "injected"]
        control = group[group["variant"] == "control"]
        norm = injected["normalized_return"].to_numpy(dtype=float)
        low, high = bootstrap_mean_ci(norm)
        out.append(
            {
                "task": task_id,
                "method": method,
                "role": group["role"].iloc[0],
                "failure_rate": float(injected["failed"].mean()),
                "control_failure_rate": float(control["failed"].mean()) if len(control) else math.nan,
                "normalized_return": float(np.nanmean(norm)) if np.isfinite(norm).any() else math.nan,
                "ci_low": low,
                "ci_high": high,
                "n_seeds": int(injected["seed"].nunique()),
            }
        )
    order = {"baseline": 0, "matched-fix": 1, "other": 2}
    return sorted(out, key=lambda r: (r["task"], order.get(r["role"], 3), r["method"]))


def score(table: pd.DataFrame) -> dict:
    """The JSON object `stabench score --json` prints."""
    return {"stabilizer_track": stabilizer_track(table)}


def format_table(result: dict) -> str:
    frame = pd.DataFrame(result["stabilizer_track"])
    if frame.empty:
        return "no runs to score"
    frame["normalized_return (95% CI)"] = [
        f"{r.normalized_return:6.3f} [{r.ci_low:6.3f}, {r.ci_high:6.3f}]" for r in frame.itertuples()
    ]
    cols = ["task", "method", "role", "failure_rate", "control_failure_rate", "normalized_return (95% CI)", "n_seeds"]
    return frame[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}")
