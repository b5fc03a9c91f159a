"""Statistics over per-run outcomes (`suite.outcomes`), the stabilizer track's numbers. Pure functions.

- per task and method (`stabilizer_track`): failure rates with the counts behind them, and the mean normalized
  return of the injected runs with a 95% percentile-bootstrap interval over seeds (scipy, fixed seed);
- across tasks (the rliable protocol, Agarwal et al. 2021, `across_tasks`): the interquartile mean of the
  normalized returns of all (task, seed) runs, with a stratified bootstrap 95% interval (seeds resampled within
  each task), and the probability of improvement over the baseline, P(X > Y) + P(X = Y) / 2 from the
  Mann-Whitney U statistic per task, averaged over tasks, with the same stratified interval.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import stats
from stabench.suite.outcomes import outcomes

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


# The order methods are listed in, by role: the baseline, the matched fix, the others, the references.
ROLE_ORDER = {"baseline": 0, "matched-fix": 1, "other": 2, "reference": 3}


def bootstrap_mean_ci(values: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of `values` (NaN dropped; one value, or all equal: that value)."""
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
        healthy = control["normalized_return"].to_numpy(dtype=float)
        out.append(
            {
                "task": task_id,
                "method": method,
                "role": group["role"].iloc[0],
                "acts": bool(group["acts"].all()) if "acts" in group else True,
                "failure_rate": float(injected["failed"].mean()),
                "control_failure_rate": float(control["failed"].mean()) if len(control) else math.nan,
                # the counts behind both rates, for their binomial intervals (`suite.calibration`)
                "failed_runs": int(injected["failed"].sum()),
                "runs": int(len(injected)),
                "control_failed_runs": int(control["failed"].sum()),
                "control_runs": int(len(control)),
                "normalized_return": float(np.nanmean(norm)) if np.isfinite(norm).any() else math.nan,
                "ci_low": low,
                "ci_high": high,
                # the cost of the method on healthy training: the control's normalized return beside it
                "control_normalized_return": float(np.nanmean(healthy)) if np.isfinite(healthy).any() else math.nan,
                "n_seeds": int(injected["seed"].nunique()),
                "drawdown": float(injected["drawdown"].mean()),
            }
        )
    return sorted(out, key=lambda r: (r["task"], ROLE_ORDER.get(r["role"], 3), r["method"]))


def iqm(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
    """The interquartile mean of the samples joined (25% trimmed from each end), along `axis`."""
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


def common_tasks(per_run: pd.DataFrame) -> list[str]:
    """The tasks every method is compared on: those the baseline ran on."""
    return sorted(per_run.loc[per_run["method"] == "baseline", "task"].unique())


def across_tasks(per_run: pd.DataFrame) -> list[dict]:
    """Per method, across tasks: IQM of normalized return and probability of improvement over the baseline.

    A method is `ranked` when it has runs on every task of the common set (`common_tasks`; a method that
    does not change a task's trainer has the baseline's runs there, marked `acts` False), and its aggregate
    then covers exactly that set. A method with runs on only some of them is reported over those, unranked:
    its number compares tasks, not methods. `acts_on` lists the tasks where the method really acts.
    """
    injected = per_run[per_run["variant"] == "injected"].dropna(subset=["normalized_return"])
    samples = {
        (task, method): g.sort_values("seed")["normalized_return"].to_numpy(float)
        for (task, method), g in injected.groupby(["task", "method"])
    }
    acting = {(t, m) for (t, m), g in injected.groupby(["task", "method"])
              if ("acts" not in g) or bool(g["acts"].all())}
    common = set(common_tasks(per_run))
    out = []
    for method in sorted(injected["method"].unique()):
        tasks = sorted(t for t, m in samples if m == method)
        ranked = bool(common) and common <= set(tasks)
        if ranked:
            tasks = sorted(common)
        own = [samples[(t, method)] for t in tasks]
        low, high = _stratified_ci(iqm, own)
        row = {"method": method, "n_tasks": len(tasks), "ranked": ranked,
               "acts_on": [t for t in tasks if (t, method) in acting],
               "iqm": float(iqm(*own)), "ci_low": low, "ci_high": high}
        shared = [t for t in tasks if (t, "baseline") in samples]
        if shared:
            pairs = [a for t in shared for a in (samples[(t, method)], samples[(t, "baseline")])]
            p_low, p_high = _stratified_ci(_poi, pairs)
            row.update(probability_of_improvement=float(_poi(*pairs)), poi_ci_low=p_low, poi_ci_high=p_high)
        out.append(row)
    return out
