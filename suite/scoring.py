"""Scores from the tidy table. Pure functions: a table in, numbers out.

Stabilizer track, per task and method:
- failure: a run fails when its task's ground truth crosses the threshold after onset (see
  `suite.api.GroundTruth`); a diverged run counts as failed.
- normalized return: the mean true return over the post-onset iterations, mapped through the task's
  fixed floor and ceiling, (R - floor) / (ceiling - floor). Iterations a diverged run never reached
  count at the floor. The 95% interval is a percentile bootstrap over seeds (scipy, fixed seed).
- drawdown: the largest fall of the normalized return after onset below its own running maximum
  (from onset on), a stability figure the mean hides.
- across tasks (the rliable protocol, Agarwal et al. 2021): the interquartile mean of the normalized
  returns of all (task, seed) runs, with a stratified bootstrap 95% interval (seeds resampled within
  each task), and the probability of improvement over the baseline, P(X > Y) + P(X = Y) / 2 from the
  Mann-Whitney U statistic per task, averaged over tasks, with the same stratified interval.

Detector track, per task and detector, on the baseline method's runs (after the Numenta Anomaly
Benchmark's scoring, standard profile A_TP = 1, A_FN = 1, A_FP = 0.11):
- an alarm event is a row whose alarm is raised when the previous row's was not;
- a failing injected run (its ground truth crossed) is detected by its first alarm event inside the
  detection window [onset, onset + W), W = the task's `detection_window` share of the post-onset horizon;
  at relative position y = latency / W - 1 in [-1, 0) it earns A_TP * (2 / (1 + e^(5y)) - 1); a miss
  (no alarm event in the window) costs A_FN and its latency counts as the whole post-onset horizon;
- every alarm event before onset, and every alarm event on a control run, is a false alarm costing A_FP;
- score = 100 (S - S_never) / (S_oracle - S_never), clipped to [0, 100], where S_never = -A_FN x failures
  (no alarm) and S_oracle alarms exactly at onset on every failing run. An alarm held from before onset
  is not a detection, so `always` earns only false alarms.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import stats

from suite import registry
from suite.api import GroundTruth, Task

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
NAB = {"tp": 1.0, "fn": 1.0, "fp": 0.11}


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


def post_onset_drawdown(rows: pd.DataFrame, task: Task, onset: int) -> float:
    """Largest drop of the normalized return below its running maximum after onset (0 = monotone)."""
    post = rows.loc[rows["iteration"] >= onset, "return"].astype(float).dropna()
    if post.empty:
        return math.nan
    norm = post.map(task.normalized_return).to_numpy()
    return float(np.max(np.maximum.accumulate(norm) - norm))


def _plain(value: object) -> object:
    """A numpy scalar read back from parquet as the Python value a task's constructor expects (a table
    that joins runs with and without knobs stores integer knobs as floats: 16.0 is the knob 16)."""
    value = value.item() if hasattr(value, "item") else value
    return int(value) if isinstance(value, float) and value.is_integer() else value


def outcomes(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, method, seed, variant): failed, post-onset return, normalized return."""
    rows = []
    tasks: dict[str, Task] = {}
    # runs without knobs have an empty cell (NaN when joined with a grid; groupby would drop NaN keys)
    table = table.assign(cell=table["cell"].fillna("") if "cell" in table else "")
    keys = ["task", "cell", "method", "seed", "variant"]
    for (task_id, cell, method, seed, variant), run in table.groupby(keys, sort=True):
        ref = run["task_ref"].iloc[0] if "task_ref" in run else task_id
        knobs = {c[len("knob_"):]: _plain(run[c].iloc[0]) for c in run.columns if c.startswith("knob_") and cell}
        task = tasks.setdefault(f"{ref}|{cell}", registry.get_task(ref, **knobs))
        run = run.sort_values("iteration")
        onset, iterations = int(run["onset_iteration"].iloc[0]), int(run["iterations"].iloc[0])
        ret = post_onset_return(run, task, onset, iterations)
        rows.append(
            {
                "task": f"{task_id} [{cell}]" if cell else task_id,
                "method": method,
                "role": run["role"].iloc[0],
                "seed": seed,
                "variant": variant,
                "failed": run_failed(run, task.ground_truth, onset, iterations),
                "diverged": bool((run["status"] == "diverged").any()),
                "post_onset_return": ret,
                "normalized_return": task.normalized_return(ret) if not math.isnan(ret) else math.nan,
                "drawdown": post_onset_drawdown(run, task, onset),
            }
        )
    return pd.DataFrame(rows)


def bootstrap_mean_ci(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return math.nan, math.nan
    if len(values) == 1 or np.all(values == values[0]):
        return float(values[0]), float(values[0])
    with warnings.catch_warnings():  # a degenerate resample gives a NaN interval: missing, said so
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        res = stats.bootstrap(
            (values,),
            np.mean,
            confidence_level=confidence,
            n_resamples=BOOTSTRAP_RESAMPLES,
            method="percentile",
            rng=np.random.default_rng(BOOTSTRAP_SEED),
        )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def stabilizer_track(table: pd.DataFrame, per_run: pd.DataFrame | None = None) -> list[dict]:
    """Per task and method: failure rates, normalized return with its 95% interval, number of seeds."""
    out = []
    per_run = outcomes(table) if per_run is None else per_run
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
                "drawdown": float(injected["drawdown"].mean()),
            }
        )
    order = {"baseline": 0, "matched-fix": 1, "other": 2}
    return sorted(out, key=lambda r: (r["task"], order.get(r["role"], 3), r["method"]))


def _iqm(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
    return stats.trim_mean(np.concatenate(samples, axis=axis), 0.25, axis=axis)


def _poi(*pairs: np.ndarray, axis: int = -1) -> np.ndarray:
    """Mean over tasks of P(X > Y) + P(X = Y) / 2; `pairs` alternates x and y samples of each task."""
    per_task = []
    for x, y in zip(pairs[0::2], pairs[1::2]):
        x, y = np.moveaxis(x, axis, -1), np.moveaxis(y, axis, -1)
        gt = (x[..., :, None] > y[..., None, :]).mean((-2, -1))
        eq = (x[..., :, None] == y[..., None, :]).mean((-2, -1))
        per_task.append(gt + 0.5 * eq)
    return np.mean(per_task, axis=0)


def _stratified_ci(statistic, samples: list[np.ndarray]) -> tuple[float, float]:
    """Percentile interval of a bootstrap that resamples each sample (one per task) on its own."""
    if all(len(s) < 2 or np.all(s == s[0]) for s in samples):
        value = float(statistic(*samples))
        return value, value
    with warnings.catch_warnings():  # a degenerate resample gives a NaN interval: missing, said so
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        res = stats.bootstrap(
            tuple(samples),
            statistic,
            n_resamples=BOOTSTRAP_RESAMPLES // 5,
            method="percentile",
            vectorized=True,
            rng=np.random.default_rng(BOOTSTRAP_SEED),
        )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def aggregate(per_run: pd.DataFrame) -> list[dict]:
    """Per method, across the tasks it ran on: IQM of normalized return and probability of improvement."""
    injected = per_run[per_run["variant"] == "injected"].dropna(subset=["normalized_return"])
    samples = {
        (task, method): g.sort_values("seed")["normalized_return"].to_numpy(float)
        for (task, method), g in injected.groupby(["task", "method"])
    }
    out = []
    for method in sorted(injected["method"].unique()):
        tasks = sorted(t for t, m in samples if m == method)
        own = [samples[(t, method)] for t in tasks]
        low, high = _stratified_ci(_iqm, own)
        row = {"method": method, "n_tasks": len(tasks), "iqm": float(_iqm(*own)), "ci_low": low, "ci_high": high}
        shared = [t for t in tasks if (t, "baseline") in samples]
        if shared:
            pairs = [a for t in shared for a in (samples[(t, method)], samples[(t, "baseline")])]
            p_low, p_high = _stratified_ci(_poi, pairs)
            row.update(probability_of_improvement=float(_poi(*pairs)), poi_ci_low=p_low, poi_ci_high=p_high)
        out.append(row)
    return out


def _nab_reward(y: float) -> float:
    return 2.0 / (1.0 + math.exp(5.0 * y)) - 1.0


def detector_runs(table: pd.DataFrame, per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (task, detector, seed, variant) of the baseline's runs: its additive share of the score.

    Columns: `s` (NAB score earned), `null` and `perfect` (what `never` and the oracle earn on this run),
    `failure` (the run is a failing injected run), `detected`, `latency_steps`, `latency_frac`,
    `false_iterations` and `negative_iterations` (iterations where any alarm is false).
    """
    per_run = outcomes(table) if per_run is None else per_run
    failed = {(r.task, r.seed, r.variant): r.failed for r in per_run[per_run["role"] == "baseline"].itertuples()}
    base = table[table["role"] == "baseline"]
    base = base.assign(cell=base["cell"].fillna("") if "cell" in base else "")
    alarm_columns = [c for c in table.columns if c.startswith("alarm/")]
    rows = []
    for (name, cell), task_rows in base.groupby(["task", "cell"], sort=True):
        task_id = f"{name} [{cell}]" if cell else name
        ref = task_rows["task_ref"].iloc[0] if "task_ref" in task_rows else name
        knobs = {c[len("knob_"):]: _plain(task_rows[c].iloc[0]) for c in task_rows if c.startswith("knob_") and cell}
        task = registry.get_task(ref, **knobs)
        for (seed, variant), run in task_rows.groupby(["seed", "variant"], sort=True):
            run = run.sort_values("iteration")
            onset, horizon = int(run["onset_iteration"].iloc[0]), int(run["iterations"].iloc[0])
            window = max(1, math.ceil(task.detection_window * (horizon - onset)))
            it = run["iteration"].to_numpy()
            steps = run["step"].to_numpy(float)
            before = steps[it == onset - 1]
            start = float(before[0]) if len(before) else 0.0
            failure = variant == "injected" and failed.get((task_id, seed, variant), False)
            negative = (it < onset) if variant == "injected" else np.ones(len(it), bool)
            for column in [*alarm_columns, "alarm/oracle"]:
                detector = column.split("/", 1)[1]
                if detector == "oracle":
                    alarms = (it == onset) & failure
                elif column in run:
                    alarms = run[column].astype("boolean").fillna(False).to_numpy(bool)
                else:
                    alarms = np.zeros(len(it), bool)
                events = alarms & ~np.concatenate([[False], alarms[:-1]])
                row = {
                    "task": task_id,
                    "detector": detector,
                    "diagnostic": _diagnostic_of(detector, task),
                    "seed": seed,
                    "variant": variant,
                    "s": -NAB["fp"] * int((events & negative).sum()),
                    "null": -NAB["fn"] if failure else 0.0,
                    "perfect": NAB["tp"] * _nab_reward(-1.0) if failure else 0.0,
                    "failure": failure,
                    "detected": False,
                    "latency_steps": math.nan,
                    "latency_frac": math.nan,
                    "false_iterations": int((alarms & negative).sum()),
                    "negative_iterations": int(negative.sum()),
                }
                if failure:
                    hits = np.flatnonzero(events & (it >= onset) & (it < onset + window))
                    if len(hits):
                        latency = it[hits[0]] - onset
                        row.update(detected=True, latency_frac=latency / (horizon - onset),
                                   latency_steps=float(steps[hits[0]]) - start)
                        row["s"] += NAB["tp"] * _nab_reward(latency / window - 1.0)
                    else:
                        row.update(latency_frac=1.0, latency_steps=float(np.nanmax(steps)) - start)
                        row["s"] -= NAB["fn"]
                rows.append(row)
    return pd.DataFrame(rows)


def normalized_detector_score(s: float, null: float, perfect: float) -> float:
    """100 (S - S_never) / (S_oracle - S_never), clipped to [0, 100]; NaN when nothing failed."""
    if perfect - null <= 0:
        return math.nan
    return float(np.clip(100 * (s - null) / (perfect - null), 0, 100))


def detector_track(table: pd.DataFrame, per_run: pd.DataFrame | None = None) -> list[dict]:
    """Per task and detector: detection rate, latency, false alarms per 1,000 iterations, 0-100 score."""
    runs = detector_runs(table, per_run)
    out = []
    if runs.empty:
        return out
    for (task_id, detector), g in runs.groupby(["task", "detector"], sort=False):
        fails = g[g["failure"]]
        negative = int(g["negative_iterations"].sum())
        out.append(
            {
                "task": task_id,
                "detector": detector,
                "diagnostic": g["diagnostic"].iloc[0],
                "detection_rate": float(fails["detected"].mean()) if len(fails) else math.nan,
                "median_latency_steps": float(fails["latency_steps"].median()) if len(fails) else math.nan,
                "median_latency_frac": float(fails["latency_frac"].median()) if len(fails) else math.nan,
                "false_alarms_per_1k": 1000 * int(g["false_iterations"].sum()) / negative if negative else 0.0,
                "score": normalized_detector_score(g["s"].sum(), g["null"].sum(), g["perfect"].sum()),
                "n_failures": len(fails),
            }
        )
    return out


def _diagnostic_of(detector: str, task: Task) -> str:
    if detector == "oracle":
        return f"ground truth ({task.ground_truth.metric})"
    if detector in ("never", "always", "random"):
        return "-"
    return task.detector.metric


def score(table: pd.DataFrame) -> dict:
    """The JSON object `stabench score --json` prints."""
    per_run = outcomes(table)
    return {
        "stabilizer_track": stabilizer_track(table, per_run),
        "aggregate": aggregate(per_run),
        "detector_track": detector_track(table, per_run),
    }


def format_markdown(result: dict) -> str:
    """The score tables as Markdown (for `results/calibration.md` and the paper)."""

    def table(rows: list[dict], columns: list[str]) -> str:
        def cell(v: object) -> str:
            return f"{v:.3g}" if isinstance(v, float) else str(v)

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
        return "\n".join(lines)

    stab = [{**r, "normalized return [95% CI]": f"{r['normalized_return']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"}
            for r in result["stabilizer_track"]]
    parts = ["### Stabilizer track", "", table(stab, ["task", "method", "role", "failure_rate", "control_failure_rate",
                                                     "normalized return [95% CI]", "drawdown", "n_seeds"])]
    agg = [{**r, "IQM [95% CI]": f"{r['iqm']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
            "P(improve) [95% CI]": (f"{r['probability_of_improvement']:.2f} [{r['poi_ci_low']:.2f}, "
                                    f"{r['poi_ci_high']:.2f}]") if "probability_of_improvement" in r else "-"}
           for r in result.get("aggregate", [])]
    if agg:
        parts += ["", "### Across tasks", "", table(agg, ["method", "n_tasks", "IQM [95% CI]", "P(improve) [95% CI]"])]
    det = result.get("detector_track", [])
    if det:
        parts += ["", "### Detector track", "", table(det, ["task", "detector", "diagnostic", "detection_rate",
                                                            "median_latency_frac", "false_alarms_per_1k", "score"])]
    return "\n".join(parts) + "\n"


def format_table(result: dict) -> str:
    """The human-readable form of `score`: three tables."""
    parts = []
    frame = pd.DataFrame(result["stabilizer_track"])
    if frame.empty:
        return "no runs to score"
    frame["normalized_return (95% CI)"] = [
        f"{r.normalized_return:6.3f} [{r.ci_low:6.3f}, {r.ci_high:6.3f}]" for r in frame.itertuples()
    ]
    cols = ["task", "method", "role", "failure_rate", "control_failure_rate", "normalized_return (95% CI)",
            "drawdown", "n_seeds"]
    parts.append("stabilizer track\n" + frame[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    agg = pd.DataFrame(result.get("aggregate", []))
    if not agg.empty:
        agg["IQM (95% CI)"] = [f"{r.iqm:6.3f} [{r.ci_low:6.3f}, {r.ci_high:6.3f}]" for r in agg.itertuples()]
        if "probability_of_improvement" in agg:
            agg["P(improve over baseline) (95% CI)"] = [
                f"{r.probability_of_improvement:4.2f} [{r.poi_ci_low:4.2f}, {r.poi_ci_high:4.2f}]"
                if not pd.isna(r.probability_of_improvement) else "-"
                for r in agg.itertuples()
            ]
        keep = [c for c in ("method", "n_tasks", "IQM (95% CI)", "P(improve over baseline) (95% CI)") if c in agg]
        parts.append("across tasks\n" + agg[keep].to_string(index=False))
    det = pd.DataFrame(result.get("detector_track", []))
    if not det.empty:
        cols = ["task", "detector", "diagnostic", "detection_rate", "median_latency_frac", "false_alarms_per_1k",
                "score"]
        parts.append("detector track\n" + det[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return "\n\n".join(parts)
