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

Detector track, per task and detector, on every run of the task (all methods): a chance-corrected,
timed skill score in the spirit of the Peirce / true skill statistic (hit rate minus false-alarm rate).
- the first alarm t_a of a run is its first iteration >= onset with the alarm raised (an alarm held
  from before onset counts at onset); its credit is w = 1 - (t_a - onset) / H, H the post-onset horizon
  (iterations - onset): the share of the horizon still ahead, strictly decreasing, no cliff; no alarm: 0;
- positives: injected runs that fail (any method); negatives: control runs that stay healthy and
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

import numpy as np
import pandas as pd
from scipy import stats
from stabench.suite import registry
from stabench.suite.api import GroundTruth, StabenchError, Task

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
LEAD_SMOOTHING, LEAD_MARGIN, LEAD_PERSIST = 5, 0.10, 3  # the lead time's "visible in the return"


# The order methods are listed in, by role: the baseline, the matched fix, the others, the references.
ROLE_ORDER = {"baseline": 0, "matched-fix": 1, "other": 2, "reference": 3}


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


def check_version(rows: pd.DataFrame, task: Task | type[Task]) -> None:
    """Refuse rows made by another version of the task: its floor, ceiling and threshold are recorded for the
    registry's version only, and today's anchors on yesterday's rows would score them silently wrong."""
    if "task_version" not in rows:
        return
    made = sorted({str(v) for v in rows["task_version"].dropna().unique()} - {str(task.version)})
    if made:
        raise StabenchError(
            f"{task.id}: the rows were made by task version {', '.join(made)}, this suite's {task.id} is version "
            f"{task.version}, whose floor, ceiling and threshold would score them wrongly: rerun the task, or score "
            "the rows with the suite that made them"
        )


def check_versions(table: pd.DataFrame) -> None:
    """`check_version` for every task of a table at once: a caller that draws or writes before it scores (the
    paper) refuses first."""
    if "task_version" not in table:
        return
    by = "task_ref" if "task_ref" in table else "task"
    for ref, rows in table.groupby(by, sort=True):
        check_version(rows, registry.resolve_class("task", ref))


def task_of(rows: pd.DataFrame, cell: str, cache: dict[str, Task] | None = None) -> Task:
    """The task that made `rows` (rows of one task and grid cell), built with the cell's `knob_*` values; rows of
    another task version are refused (`check_version`)."""
    ref = rows["task_ref"].iloc[0] if "task_ref" in rows else rows["task"].iloc[0]
    key = f"{ref}|{cell}"
    if cache is not None and key in cache:
        task = cache[key]
    else:
        knobs = {c[len("knob_"):]: _plain(rows[c].iloc[0]) for c in rows.columns if c.startswith("knob_") and cell}
        task = registry.get_task(ref, **knobs)
        if cache is not None:
            cache[key] = task
    check_version(rows, task)
    return task


def outcomes(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, method, seed, variant): failed, post-onset return, normalized return."""
    rows = []
    tasks: dict[str, Task] = {}
    # runs without knobs have an empty cell (NaN when joined with a grid; groupby would drop NaN keys)
    table = table.assign(cell=table["cell"].fillna("") if "cell" in table else "")
    keys = ["task", "cell", "method", "seed", "variant"]
    for (task_id, cell, method, seed, variant), run in table.groupby(keys, sort=True):
        task = task_of(run, cell, tasks)
        run = run.sort_values("iteration")
        onset, iterations = int(run["onset_iteration"].iloc[0]), int(run["iterations"].iloc[0])
        ret = post_onset_return(run, task, onset, iterations)
        rows.append(
            {
                "task": f"{task_id} [{cell}]" if cell else task_id,
                "method": method,
                "role": run["role"].iloc[0],
                # False: the method does not change this task's trainer, and these are the baseline's rows
                "acts": bool(run["acts"].iloc[0]) if "acts" in run else True,
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
        low, high = _stratified_ci(_iqm, own)
        row = {"method": method, "n_tasks": len(tasks), "ranked": ranked,
               "acts_on": [t for t in tasks if (t, method) in acting],
               "iqm": float(_iqm(*own)), "ci_low": low, "ci_high": high}
        shared = [t for t in tasks if (t, "baseline") in samples]
        if shared:
            pairs = [a for t in shared for a in (samples[(t, method)], samples[(t, "baseline")])]
            p_low, p_high = _stratified_ci(_poi, pairs)
            row.update(probability_of_improvement=float(_poi(*pairs)), poi_ci_low=p_low, poi_ci_high=p_high)
        out.append(row)
    return out


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
    at = math.nan
    if control is not None and len(control) and "return" in injected and "return" in control:
        def smooth(run: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
            values = pd.Series(run["return"].to_numpy(float)).rolling(LEAD_SMOOTHING, min_periods=1).mean()
            return run["iteration"].to_numpy(), values.to_numpy()

        (it_i, inj), (it_c, ctl) = smooth(injected), smooth(control)
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


def detector_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The rows the detector track scores: the reference stabilizers' runs and a method's copies of the baseline's
    runs (`acts` False, in the method matrix) left out, so a replay can skip what would be dropped anyway."""
    if "role" in table:  # learners that do not learn fail in both branches for want of learning: not the failure
        table = table[table["role"] != "reference"]
    if "acts" in table:  # a method's copies of the baseline's runs are not runs of their own
        table = table[table["acts"].fillna(True).astype(bool)]
    return table


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
    (`method_prior`).
    """
    per_run = outcomes(table) if per_run is None else per_run
    failed = {(r.task, r.method, r.seed, r.variant): bool(r.failed) for r in per_run.itertuples()}
    table = detector_rows(table)
    table = table.assign(cell=table["cell"].fillna("") if "cell" in table else "")
    alarm_columns = [c for c in table.columns if c.startswith("alarm/")]
    scored = [c.split("/", 1)[1] for c in alarm_columns]
    scored += [d for d in registry.SCORED_DETECTORS if d not in scored]
    rows = []
    for (name, cell), task_rows in table.groupby(["task", "cell"], sort=True):
        task_id = f"{name} [{cell}]" if cell else name
        task = task_of(task_rows, cell)
        diagnostics = {d: _diagnostic_of(d, task) for d in scored}
        runs = {key: run.sort_values("iteration") for key, run in task_rows.groupby(["method", "seed", "variant"])}
        prior = method_prior({(m, s): failed.get((task_id, m, s, v), False) for m, s, v in runs if v == "injected"})
        for (method, seed, variant), run in runs.items():
            onset, iterations = int(run["onset_iteration"].iloc[0]), int(run["iterations"].iloc[0])
            horizon = iterations - onset
            fails = failed.get((task_id, method, seed, variant), False)
            injected = variant == "injected"
            kind = ("positive" if fails else "healthy-injected") if injected else ("excluded" if fails else "control")
            it = run["iteration"].to_numpy()
            steps = run["step"].to_numpy(float) if "step" in run else it.astype(float)
            before = steps[it == onset - 1]
            start = float(before[0]) if len(before) else 0.0
            visible = math.nan
            if kind == "positive":
                visible = visible_failure_at(run, runs.get((method, seed, "control")), task, onset)
            post = it >= onset
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
                    column = f"alarm/{detector}"
                    alarms = (run[column].astype("boolean").fillna(False).to_numpy(bool) if column in run
                              else np.zeros(len(it), bool))
                    hits = np.flatnonzero(alarms & post)
                    first = float(it[hits[0]]) if len(hits) else math.nan
                delay = first - onset
                detected = math.isfinite(first)
                step_at = float(steps[it == first][0]) if detected and (it == first).any() else math.nan
                rows.append({
                    "task": task_id, "detector": detector, "diagnostic": diagnostics[detector], "method": method,
                    "role": run["role"].iloc[0] if "role" in run else "", "seed": seed, "variant": variant,
                    "kind": kind, "failure": kind == "positive", "detected": detected, "first_alarm": first,
                    "horizon": horizon, "credit": delay_credit(delay, horizon),
                    "latency_frac": delay / horizon if detected else 1.0,
                    "latency_steps": (step_at - start if detected else float(np.nanmax(steps)) - start),
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


def score(table: pd.DataFrame) -> dict:
    """The JSON object `stabench score --json` prints."""
    per_run = outcomes(table)
    return {
        "stabilizer_track": stabilizer_track(table, per_run),
        "aggregate": across_tasks(per_run),
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
    parts = ["### Stabilizer track", "", table(stab, ["task", "method", "role", "acts", "failure_rate",
                                                     "control_failure_rate",
                                                     "normalized return [95% CI]", "control_normalized_return",
                                                     "drawdown", "n_seeds"])]
    agg = [{**r, "IQM [95% CI]": f"{r['iqm']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
            "P(improve) [95% CI]": (f"{r['probability_of_improvement']:.2f} [{r['poi_ci_low']:.2f}, "
                                    f"{r['poi_ci_high']:.2f}]") if "probability_of_improvement" in r else "-"}
           for r in result.get("aggregate", [])]
    if agg:
        for r in agg:
            unranked = "" if r.get("ranked", True) else " (unranked)"
            r["acts on"] = f"{len(r.get('acts_on', []))}/{r['n_tasks']}{unranked}"
        parts += ["", "### Across tasks", "", table(agg, ["method", "n_tasks", "acts on", "IQM [95% CI]",
                                                          "P(improve) [95% CI]"])]
    det = result.get("detector_track", [])
    if det:
        det = [{**r, "score [95% CI]": _score_ci(r)} for r in det]
        parts += ["", "### Detector track", "", table(det, ["task", "detector", "diagnostic", "score [95% CI]",
                                                            "detection_rate", "median_latency_frac",
                                                            "false_alarm_rate", "median_lead", "warned_before"])]
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
    cols = ["task", "method", "role", "acts", "failure_rate", "control_failure_rate", "normalized_return (95% CI)",
            "control_normalized_return", "drawdown", "n_seeds"]
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
        if "acts_on" in agg:
            agg["acts on"] = [f"{len(r.acts_on)}/{r.n_tasks}" + ("" if r.ranked else " unranked")
                              for r in agg.itertuples()]
        keep = [c for c in ("method", "n_tasks", "acts on", "IQM (95% CI)", "P(improve over baseline) (95% CI)")
                if c in agg]
        parts.append("across tasks\n" + agg[keep].to_string(index=False))
    det = pd.DataFrame(result.get("detector_track", []))
    if not det.empty:
        det["score (95% CI)"] = [_score_ci(r) for r in det.to_dict("records")]
        cols = ["task", "detector", "diagnostic", "score (95% CI)", "detection_rate", "median_latency_frac",
                "false_alarm_rate", "median_lead", "warned_before"]
        parts.append("detector track\n" + det[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return "\n\n".join(parts)


def _score_ci(row: dict) -> str:
    """`41.2 [30.1, 52.0]` (the detector skill score and its interval), `-` when nothing failed."""
    value, low, high = (row.get(k, math.nan) for k in ("score", "ci_low", "ci_high"))
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:5.1f} [{low:5.1f}, {high:5.1f}]"
