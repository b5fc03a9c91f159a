"""The detector track: a chance-corrected, timed skill score per task and detector, on every run of the task
(all methods). Pure functions: a table in, numbers out.

The score is in the spirit of the Peirce / true skill statistic (hit rate minus false-alarm rate):
- the first alarm t_a of a run is its first iteration >= onset with the alarm raised (an alarm held
  from before onset counts at onset); its credit is w = 1 - (t_a - onset) / H, H the post-onset horizon
  (iterations - onset): the share of the horizon still ahead, strictly decreasing, no cliff; no alarm: 0;
- positives: injected runs that fail (any method, `suite.outcomes`); negatives: control runs that stay healthy and
  injected runs that stay healthy (the fixes'); a control run that fails is neither (it is left out);
- score = 100 (mean w over positives - 1/2 (mean w over healthy controls + mean w over healthy injected
  runs)), the controls alone when no injected run stayed healthy; reported unclipped (below 0 = worse
  than chance), NaN when no run failed. A detector blind to the outcome (`never`, `always`, `random` at
  any rate) earns the same credit on positives and negatives: about 0. The `oracle` (alarms at onset on
  the positives) scores 100, an oracle delayed by d iterations 100 (1 - d / H); `injection` (alarms at
  onset on every injected run) scores 50 where some injected runs stay healthy, and an oracle that also
  alarms on every control run 50; `method-prior` (alarms at onset on an injected run when its method's injected
  runs on the task's other seeds mostly failed, never on a control: `method_prior`) is what knowing the method
  is worth, the reference a detector must beat to show it reads the failure (about 88 on the method matrix);
- false-alarm rate: the share of healthy runs (controls, and injected runs that stayed healthy) with an alarm at
  or after onset, reported beside the median lead (`detector_track`; `alarm_summary` for a leaderboard row);
- 95% interval: percentile bootstrap that resamples seeds within each method (all runs of a resampled
  seed together), numpy with a fixed seed;
- lead time, per detected positive: visible_at - t_a, where visible_at is the first post-onset iteration
  from which, for 3 iterations in a row, the 5-iteration trailing mean of the run's true return lies
  below its control's (same seed and method) by more than 10% of (ceiling - floor) (a diverged run: at
  the divergence at the latest). Positive = warned before the return showed anything; reported as the
  median and the share warned before, over the detected positives whose failure became visible.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import numpy as np
import pandas as pd
from stabench.suite import registry
from stabench.suite.api import Task
from stabench.suite.outcomes import cells_of, outcomes, runs_of, task_of
from stabench.suite.statistics import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED

LEAD_SMOOTHING, LEAD_MARGIN, LEAD_PERSIST = 5, 0.10, 3  # the lead time's "visible in the return"


def delay_credit(delay: float, horizon: int) -> float:
    """w(d) = 1 - d / H: the share of the post-onset horizon H still ahead when the alarm came (0 if none)."""
    if delay is None or not math.isfinite(delay):
        return 0.0
    return float(1.0 - min(max(delay, 0.0), horizon) / horizon)


def visible_failure_at(injected: pd.DataFrame, control: pd.DataFrame | None, task: Task, onset: int) -> float:
    """The iteration from which a failure shows in the true return, NaN if it never does.

    The first post-onset iteration t such that, at t, t+1 and t+2, the trailing 5-iteration mean of the
    injected run's `return` lies below the same seed and method's control (same smoothing) by more than
    10% of (ceiling - floor); a run that diverged shows its failure at the divergence at the latest.
    """
    stop = injected["diverged_at"].max() if "diverged_at" in injected else math.nan

    def arrays(run: pd.DataFrame | None) -> tuple[np.ndarray, np.ndarray] | None:
        if run is None or not len(run) or "return" not in run:
            return None
        return run["iteration"].to_numpy(), run["return"].to_numpy(float)

    return visible_at(arrays(injected), arrays(control), stop, task, onset)


def visible_at(injected: tuple[np.ndarray, np.ndarray] | None, control: tuple[np.ndarray, np.ndarray] | None,
               stop: float, task: Task, onset: int) -> float:
    """`visible_failure_at` on (iterations, returns) arrays of both runs (None: no such run or no return logged)
    and the iteration the injected run diverged at (NaN if it did not)."""
    at = math.nan
    if injected is not None and control is not None:
        def smooth(iterations: np.ndarray, returns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            values = pd.Series(returns).rolling(LEAD_SMOOTHING, min_periods=1).mean()
            return iterations, values.to_numpy()

        (it_i, inj), (it_c, ctl) = smooth(*injected), smooth(*control)
        its, i_idx, c_idx = np.intersect1d(it_i, it_c, return_indices=True)
        keep = (its >= onset) & np.isfinite(inj[i_idx]) & np.isfinite(ctl[c_idx])
        its, gap = its[keep], (ctl[c_idx] - inj[i_idx])[keep]
        below = gap > LEAD_MARGIN * abs(task.return_ceiling - task.return_floor)
        for i in range(len(below) - LEAD_PERSIST + 1):
            if below[i:i + LEAD_PERSIST].all():
                at = float(its[i])
                break
    if math.isfinite(stop):
        at = float(stop) if math.isnan(at) else min(at, float(stop))
    return at


def detector_mask(table: pd.DataFrame) -> np.ndarray:
    """Which rows the detector track scores: the reference stabilizers' runs and a method's copies of the
    baseline's runs (`acts` False, in the method matrix) are left out."""
    keep = np.ones(len(table), dtype=bool)
    if "role" in table:  # learners that do not learn fail in both branches for want of learning: not the failure
        keep &= (table["role"] != "reference").to_numpy(bool)
    if "acts" in table:  # a method's copies of the baseline's runs are not runs of their own
        keep &= table["acts"].fillna(True).astype(bool).to_numpy(bool)
    return keep


def detector_rows(table: pd.DataFrame, columns: list[str] | None = None) -> pd.DataFrame:
    """The rows the detector track scores (`detector_mask`), so a replay can skip what would be dropped anyway;
    only `columns` when given, in one copy (the method matrix is too large to copy whole and then cut)."""
    if columns is not None:
        return table.loc[detector_mask(table), columns]
    return table[detector_mask(table)] if "role" in table or "acts" in table else table  # one copy, not one per filter


def task_slices(table: pd.DataFrame, grid: bool = True) -> Iterator[tuple[str, pd.DataFrame]]:
    """(task, its rows the track scores), task by task in sorted order, as `groupby("task")` gives them after
    `detector_rows`, but one task's rows copied at a time: a groupby copies the whole table sorted first, which on
    the method matrix doubles the paper's memory. `grid` False leaves out the rows that lie in a grid cell."""
    keep = detector_mask(table)
    if not grid and "cell" in table:
        keep &= (table["cell"].fillna("") == "").to_numpy(bool)
    names = table["task"].to_numpy()
    for name in sorted(pd.unique(names[keep & pd.notna(names)])):
        yield name, table[keep & (names == name)]


# What `detector_runs` reads of a run besides its `alarm/` and `knob_` columns.
TRACK_COLUMNS = ("task", "task_ref", "task_version", "cell", "method", "role", "seed", "variant", "iteration", "step",
                 "return", "diverged_at", "onset_iteration", "iterations")


def detector_runs(table: pd.DataFrame, per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (task, detector, method, seed, variant): the run's class and the credit it earns.

    Runs of the reference stabilizers (`no-update`, `frozen-at-onset`) are left out: they fail for want of
    learning, in both branches, which is not the failure a detector is asked to foresee.
    `kind` is `positive` (an injected run that failed), `control` (a control run that stayed healthy),
    `healthy-injected` (an injected run that stayed healthy) or `excluded` (a control run that failed:
    neither a target nor a false alarm). `first_alarm` is the first iteration >= onset with the alarm
    raised (an alarm held from before onset counts at onset), `credit` = w(first_alarm - onset), `lead`
    = visible_at - first_alarm on detected positives (positive = warned before the return showed it).
    Every `alarm/<name>` column is scored, plus `oracle`, `injection` and `method-prior` from the run's metadata
    (`method_prior`). Runs are read as slices of whole-table arrays (`outcomes.runs_of`), not as per-run frames.
    """
    per_run = outcomes(table) if per_run is None else per_run
    failed = {(r.task, r.method, r.seed, r.variant): bool(r.failed) for r in per_run.itertuples()}
    table = detector_rows(table, [c for c in table.columns
                                  if c in TRACK_COLUMNS or str(c).startswith(("alarm/", "knob_"))])
    cells = cells_of(table)
    alarm_columns = [c for c in table.columns if c.startswith("alarm/")]
    scored = [c.split("/", 1)[1] for c in alarm_columns]
    scored += [d for d in registry.SCORED_DETECTORS if d not in scored]
    alarm_of = {c.split("/", 1)[1]: table[c].astype("boolean").fillna(False).to_numpy(bool) for c in alarm_columns}
    names, methods, seeds, variants = (table[c].to_numpy() for c in ("task", "method", "seed", "variant"))
    roles = table["role"].to_numpy() if "role" in table else None
    iteration, onsets, horizons = (table[c].to_numpy() for c in ("iteration", "onset_iteration", "iterations"))
    step = table["step"].to_numpy(float) if "step" in table else None
    returns = table["return"].to_numpy(float) if "return" in table else None
    stops = table["diverged_at"].to_numpy(float) if "diverged_at" in table else None
    by_task: dict[tuple[object, str], list[np.ndarray]] = {}
    for where in runs_of(table, ["task", "cell", "method", "seed", "variant"], cells):
        by_task.setdefault((names[where[0]], cells[where[0]]), []).append(where)
    rows = []
    for (name, cell), task_runs in by_task.items():
        task_id = f"{name} [{cell}]" if cell else name
        mine = (names == name) & (cells == cell)
        task = task_of(table.loc[mine, [c for c in table.columns if c in ("task", "task_ref", "task_version")
                                        or str(c).startswith("knob_")]], cell)
        diagnostics = {d: _diagnostic_of(d, task) for d in scored}
        runs = {(methods[w[0]], seeds[w[0]], variants[w[0]]): w for w in task_runs}
        prior = method_prior({(m, s): failed.get((task_id, m, s, v), False) for m, s, v in runs if v == "injected"})
        for (method, seed, variant), where in runs.items():
            onset, iterations = int(onsets[where[0]]), int(horizons[where[0]])
            horizon = iterations - onset
            fails = failed.get((task_id, method, seed, variant), False)
            injected = variant == "injected"
            kind = ("positive" if fails else "healthy-injected") if injected else ("excluded" if fails else "control")
            it = iteration[where]
            steps = step[where] if step is not None else it.astype(float)
            before = steps[it == onset - 1]
            start = float(before[0]) if len(before) else 0.0
            role = roles[where[0]] if roles is not None else ""
            visible = math.nan
            if kind == "positive":
                stop = (float(np.nanmax(stops[where])) if stops is not None and not np.isnan(stops[where]).all()
                        else math.nan)
                control = runs.get((method, seed, "control"))
                visible = visible_at(None if returns is None else (it, returns[where]),
                                     None if returns is None or control is None
                                     else (iteration[control], returns[control]), stop, task, onset)
            post = it >= onset
            last = float(np.nanmax(steps)) - start
            for detector in scored:
                if detector == "oracle":
                    first = float(onset) if kind == "positive" else math.nan
                    alarms = (it == onset) & (kind == "positive")
                elif detector == "injection":
                    first = float(onset) if injected else math.nan
                    alarms = (it == onset) & injected
                elif detector == "method-prior":
                    warns = injected and prior.get((method, seed), False)
                    first = float(onset) if warns else math.nan
                    alarms = (it == onset) & warns
                else:
                    alarms = alarm_of[detector][where] if detector in alarm_of else np.zeros(len(it), bool)
                    hits = np.flatnonzero(alarms & post)
                    first = float(it[hits[0]]) if len(hits) else math.nan
                delay = first - onset
                detected = math.isfinite(first)
                at = np.flatnonzero(it == first) if detected else ()
                step_at = float(steps[at[0]]) if len(at) else math.nan
                rows.append({
                    "task": task_id, "detector": detector, "diagnostic": diagnostics[detector], "method": method,
                    "role": role, "seed": seed, "variant": variant,
                    "kind": kind, "failure": kind == "positive", "detected": detected, "first_alarm": first,
                    "horizon": horizon, "credit": delay_credit(delay, horizon),
                    "latency_frac": delay / horizon if detected else 1.0,
                    "latency_steps": (step_at - start if detected else last),
                    "visible_at": visible, "lead": visible - first if kind == "positive" and detected else math.nan,
                    "alarm_iterations": int(alarms.sum()), "iterations": len(it),
                })
    return pd.DataFrame(rows)


def method_prior(injected_failed: dict[tuple[str, int], bool]) -> dict[tuple[str, int], bool]:
    """The `method-prior` reference on one task: for each injected run (method, seed), whether that method's
    injected runs on the task's other seeds (its own seed left out) mostly failed (more than half); False for a
    method with no other seed. It knows which method ran and how it fares, and reads no diagnostic."""
    by_method: dict[str, dict[int, bool]] = {}
    for (method, seed), fails in injected_failed.items():
        by_method.setdefault(method, {})[seed] = bool(fails)
    out = {}
    for method, seeds in by_method.items():
        total, n = sum(seeds.values()), len(seeds)
        for seed, fails in seeds.items():
            others = n - 1
            out[(method, seed)] = others > 0 and (total - fails) / others > 0.5
    return out


_PARTS = ("positive", "control", "healthy-injected")


def _contributions(runs: pd.DataFrame) -> list[tuple[str, np.ndarray]]:
    """Per (task, method) stratum: one row per seed of [credit sum, count] for each of the three kinds."""
    columns = {}
    for kind in _PARTS:
        mine = (runs["kind"] == kind).to_numpy()
        columns[f"w {kind}"] = np.where(mine, runs["credit"].to_numpy(float), 0.0)
        columns[f"n {kind}"] = mine.astype(float)
    frame = pd.DataFrame(columns, index=runs.index).assign(task=runs["task"], method=runs["method"],
                                                           seed=runs["seed"])
    sums = frame.groupby(["task", "method", "seed"], sort=True).sum()
    return [(task_id, g.to_numpy(float)) for (task_id, _), g in sums.groupby(level=[0, 1], sort=True)]


def skill_score(totals: np.ndarray) -> np.ndarray:
    """100 (mean w over positives - 1/2 (mean w over controls + mean w over healthy injected runs)); the
    controls alone when no injected run stayed healthy. `totals[..., :]` = the six sums of `_contributions`;
    NaN where nothing failed."""
    totals = np.asarray(totals, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        hit = totals[..., 0] / totals[..., 1]
        ctl = totals[..., 2] / totals[..., 3]
        inj = totals[..., 4] / totals[..., 5]
    both = (totals[..., 3] > 0) & (totals[..., 5] > 0)
    false = np.where(both, 0.5 * (ctl + inj), np.where(totals[..., 3] > 0, ctl, inj))
    false = np.where((totals[..., 3] > 0) | (totals[..., 5] > 0), false, 0.0)
    return np.where(totals[..., 1] > 0, 100.0 * (hit - false), np.nan)


def detector_skill(runs: pd.DataFrame, resamples: int = BOOTSTRAP_RESAMPLES // 5) -> tuple[float, float, float]:
    """The mean over tasks of the skill score of one detector's runs, and its 95% percentile interval from a
    stratified bootstrap that resamples seeds within each (task, method) (numpy, fixed seed). One task: its score.
    """
    strata = _contributions(runs)
    tasks = sorted({t for t, _ in strata})
    if not tasks:
        return math.nan, math.nan, math.nan

    def per_task(sums: dict[str, np.ndarray]) -> np.ndarray:
        scores = np.stack([skill_score(sums[t]) for t in tasks])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # every task NaN in a resample: NaN, said so
            return np.nanmean(scores, axis=0)

    full: dict[str, np.ndarray] = {t: np.zeros(6) for t in tasks}
    for t, c in strata:
        full[t] = full[t] + c.sum(0)
    value = float(per_task(full))
    if math.isnan(value):
        return value, math.nan, math.nan
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    boot: dict[str, np.ndarray] = {t: np.zeros((resamples, 6)) for t in tasks}
    for t, c in strata:
        boot[t] = boot[t] + c[rng.integers(0, len(c), (resamples, len(c)))].sum(1)
    draws = per_task(boot)
    draws = draws[np.isfinite(draws)]
    if not len(draws):
        return value, math.nan, math.nan
    low, high = np.percentile(draws, [2.5, 97.5])
    return value, float(low), float(high)


def detector_track(table: pd.DataFrame, per_run: pd.DataFrame | None = None) -> list[dict]:
    """Per task and detector: the skill score with its 95% interval, hit and false-alarm credit, detection
    rate, latency, false alarms per 1,000 iterations of negative runs, and lead time."""
    runs = detector_runs(table, per_run)
    out = []
    if runs.empty:
        return out
    for (task_id, detector), g in runs.groupby(["task", "detector"], sort=False):
        pos, neg = g[g["kind"] == "positive"], g[g["kind"].isin(["control", "healthy-injected"])]
        value, low, high = detector_skill(g)
        leads = pos["lead"].dropna()
        totals = sum(c.sum(0) for _, c in _contributions(g))
        negatives = int(neg["iterations"].sum())
        out.append({
            "task": task_id,
            "detector": detector,
            "diagnostic": g["diagnostic"].iloc[0],
            "score": value,
            "ci_low": low,
            "ci_high": high,
            "hit_credit": float(totals[0] / totals[1]) if totals[1] else math.nan,
            "control_credit": float(totals[2] / totals[3]) if totals[3] else math.nan,
            "healthy_injected_credit": float(totals[4] / totals[5]) if totals[5] else math.nan,
            "detection_rate": float(pos["detected"].mean()) if len(pos) else math.nan,
            "false_alarm_rate": float(neg["detected"].mean()) if len(neg) else math.nan,
            **{f"false_alarm_rate_{kind.replace('-', '_')}": float(part["detected"].mean()) if len(part) else math.nan
               for kind in ("control", "healthy-injected") for part in [neg[neg["kind"] == kind]]},
            "median_latency_steps": float(pos["latency_steps"].median()) if len(pos) else math.nan,
            "median_latency_frac": float(pos["latency_frac"].median()) if len(pos) else math.nan,
            "false_alarms_per_1k": 1000 * int(neg["alarm_iterations"].sum()) / negatives if negatives else 0.0,
            "median_lead": float(leads.median()) if len(leads) else math.nan,
            "warned_before": float((leads > 0).mean()) if len(leads) else math.nan,
            "n_lead": len(leads),
            "n_failures": len(pos),
            "n_negatives": len(neg),
        })
    return out


def alarm_summary(runs: pd.DataFrame) -> dict:
    """One detector's alarms on healthy runs and its warning time, for a leaderboard row: `false_alarm_rate`, the
    mean over tasks of the share of healthy runs (controls, and injected runs that stayed healthy) with an alarm at
    or after onset; `median_lead`, the median lead (iterations) over every detected failing run whose failure became
    visible; and per task [false-alarm rate, median lead] (None where undefined). `runs`: `detector_runs` rows."""
    per_task, rates = {}, []
    for task_id, g in runs.groupby("task", sort=True):
        neg = g[g["kind"].isin(["control", "healthy-injected"])]
        leads = g.loc[g["kind"] == "positive", "lead"].dropna()
        rate = float(neg["detected"].mean()) if len(neg) else math.nan
        rates += [rate] if len(neg) else []
        per_task[task_id] = [None if math.isnan(rate) else round(rate, 6),
                             round(float(leads.median()), 6) if len(leads) else None]
    leads = runs.loc[runs["kind"] == "positive", "lead"].dropna()
    return {"false_alarm_rate": round(float(np.mean(rates)), 6) if rates else None,
            "median_lead": round(float(leads.median()), 6) if len(leads) else None, "per_task": per_task}


def _diagnostic_of(detector: str, task: Task) -> str:
    if detector == "oracle":
        return f"ground truth ({task.ground_truth.metric})"
    if detector == "injection":
        return "the injection (run metadata)"
    if detector == "method-prior":
        return "the method's failures on other seeds (run metadata)"
    if detector == "logistic-z":
        return "every visible diagnostic (cross-fitted)"
    if detector in ("never", "always") or detector.startswith("random"):
        return "-"
    return task.detector.metric
