"""Precision against lead time across thresholds: what a diagnostic buys in warning time for each false alarm.

Per task, its paired diagnostic (`Task.detector`: metric and side) is read as the built-in change rules read it:
standardized against the run's own healthy statistics (`suite.detectors.healthy_stats` of the first `warmup`
finite values among the pre-onset rows, the warm-up capped at the onset; a run with fewer than 2 has none and
never alarms). For each threshold k (in healthy standard deviations, on the task's side), a run alarms at its first
post-onset row beyond k. Over every run the detector track scores (all methods, `skill.detector_rows`):

- `precision`: failing runs that alarmed / all runs that alarmed (chance: the share of failing runs, `base_rate`);
- `recall`: failing runs that alarmed / failing runs; `false_alarm_rate`: healthy runs (controls and injected runs
  that stayed healthy) that alarmed / healthy runs;
- `median_lead`: over the alarmed failing runs whose failure became visible in the return
  (`skill.visible_failure_at`), the median of visible_at - first alarm, in iterations (> 0: warned before).

Pure numpy per run: the whole method matrix takes seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

THRESHOLDS = tuple(float(k) for k in np.round(np.geomspace(0.5, 32.0, 19), 2))


def precision_lead(table: pd.DataFrame, per_run: pd.DataFrame | None = None,
                   thresholds: tuple[float, ...] = THRESHOLDS) -> pd.DataFrame:
    """One row per (task, threshold): task, diagnostic, side, threshold, precision, recall, false_alarm_rate,
    median_lead, base_rate, n_failures, n_healthy (see the module docstring)."""
    from stabench.suite import outcomes, skill
    from stabench.suite.detectors import default_warmup, healthy_stats

    per_run = outcomes.outcomes(table) if per_run is None else per_run
    failed = {(r.task, r.method, r.seed, r.variant): bool(r.failed) for r in per_run.itertuples()}
    ks = np.asarray(thresholds, float)
    out = []
    for task_id, task_rows in skill.task_slices(table, grid=False):
        task = outcomes.task_of(task_rows, "")
        metric, above = task.detector.metric, task.detector.above
        if metric not in task_rows:
            continue
        budget = task.budget(str(task_rows["tier"].iloc[0]))
        onset, warmup = budget.onset, default_warmup(budget)
        runs = {key: run.sort_values("iteration") for key, run in task_rows.groupby(["method", "seed", "variant"])}
        first, kinds, leads_at = [], [], []
        for (method, seed, variant), run in runs.items():
            fails = failed.get((task_id, method, seed, variant), False)
            if variant == "control" and fails:
                continue  # neither a target nor a false alarm
            it = run["iteration"].to_numpy()
            values = run[metric].to_numpy(float)
            head = values[it < onset]
            mu, sigma = healthy_stats([float(v) for v in head[np.isfinite(head)][:warmup]])
            post = values[it >= onset]
            z = (post - mu) / sigma if math.isfinite(sigma) else np.full(len(post), np.nan)
            z = np.nan_to_num(z if above else -z, nan=-np.inf)
            alarm_at = np.full(len(ks), np.nan)
            if len(z):  # the first row beyond k: where the running maximum first exceeds it
                crossing = np.searchsorted(np.maximum.accumulate(z), ks, side="right")
                reached = crossing < len(z)
                alarm_at[reached] = it[it >= onset][crossing[reached]]
            first.append(alarm_at)
            positive = variant == "injected" and fails
            kinds.append(positive)
            leads_at.append(skill.visible_failure_at(run, runs.get((method, seed, "control")), task, onset)
                            if positive else math.nan)
        if not first or not any(kinds):
            continue
        first_arr, positive, visible = np.vstack(first), np.array(kinds), np.array(leads_at)
        alarmed = np.isfinite(first_arr)
        for j, k in enumerate(ks):
            hits, false = int((alarmed[:, j] & positive).sum()), int((alarmed[:, j] & ~positive).sum())
            lead = visible[positive] - first_arr[positive, j]
            lead = lead[np.isfinite(lead)]
            out.append({"task": task_id, "diagnostic": metric, "side": "above" if above else "below",
                        "threshold": float(k),
                        "precision": hits / (hits + false) if hits + false else math.nan,
                        "recall": hits / int(positive.sum()),
                        "false_alarm_rate": false / int((~positive).sum()) if (~positive).any() else math.nan,
                        "median_lead": float(np.median(lead)) if len(lead) else math.nan,
                        "base_rate": float(positive.mean()), "n_failures": int(positive.sum()),
                        "n_healthy": int((~positive).sum())})
    return pd.DataFrame(out)
