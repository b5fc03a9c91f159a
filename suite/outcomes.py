"""Per-run outcomes from the tidy table: one row per run (task, method, seed, variant). Pure functions.

- failure: a run fails when its task's ground truth crosses the threshold after onset (see
  `suite.api.GroundTruth`); a diverged run counts as failed.
- post-onset return: the mean true return over the post-onset iterations; iterations a diverged run never reached
  count at the task's floor. The normalized return maps it through the task's fixed floor and ceiling,
  (R - floor) / (ceiling - floor).
- drawdown: the largest fall of the normalized return after onset below its own running maximum
  (from onset on), a stability figure the mean hides.

Rows are scored only by the task version that made them (`check_version`): the floor, ceiling and threshold are
recorded per version.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from stabench.suite import registry
from stabench.suite.api import GroundTruth, StabenchError, Task


def run_failed(rows: pd.DataFrame, gt: GroundTruth, onset: int, iterations: int) -> bool:
    """Whether one run (one task, method, seed and variant; rows in iteration order) failed."""
    values = rows[gt.metric].to_numpy(dtype=float, na_value=np.nan) if gt.metric in rows else None
    return failed(rows["iteration"].to_numpy(), bool((rows["status"] == "diverged").any()), values, gt, onset,
                  iterations)


def failed(iteration: np.ndarray, diverged: bool, values: np.ndarray | None, gt: GroundTruth, onset: int,
           iterations: int) -> bool:
    """`run_failed` on one run's arrays: its iterations, whether it diverged, its ground-truth metric (None when the
    run does not log it)."""
    if diverged:
        return True
    if values is None:
        return False
    if gt.reduce == "any":
        after = values[iteration >= onset]
        crossed = after > gt.threshold if gt.fails_when == "above" else after < gt.threshold
        return bool(crossed.any())
    first = iterations - max(1, math.ceil(gt.tail * iterations))
    value = float(np.nanmean(values[iteration >= first]))
    if math.isnan(value):
        return True
    return value > gt.threshold if gt.fails_when == "above" else value < gt.threshold


def post_onset_return(rows: pd.DataFrame, task: Task, onset: int, iterations: int) -> float:
    """Mean true return after onset; iterations missing because the run diverged count at the floor."""
    stop = rows["diverged_at"].max() if "diverged_at" in rows else math.nan
    return mean_return(rows["iteration"].to_numpy(), rows["return"].to_numpy(dtype=float, na_value=np.nan), stop,
                       task.return_floor, onset, iterations)


def mean_return(iteration: np.ndarray, returns: np.ndarray, stop: float, floor: float, onset: int,
                iterations: int) -> float:
    """`post_onset_return` on one run's arrays (`stop`: the iteration it diverged at, NaN if it did not)."""
    reached = (iteration >= onset) & ~(iteration >= stop)
    observed = returns[reached]
    observed = observed[~np.isnan(observed)]  # no episode ended: missing, not zero
    missing = (iterations - onset) - int(reached.sum())  # iterations a diverged run never reached
    count = len(observed) + missing
    return float((observed.sum() + missing * floor) / count) if count else math.nan


def post_onset_drawdown(rows: pd.DataFrame, task: Task, onset: int) -> float:
    """Largest drop of the normalized return below its running maximum after onset (0 = monotone)."""
    return drawdown(rows["iteration"].to_numpy(), rows["return"].to_numpy(dtype=float, na_value=np.nan), task, onset)


def drawdown(iteration: np.ndarray, returns: np.ndarray, task: Task, onset: int) -> float:
    """`post_onset_drawdown` on one run's arrays."""
    post = returns[iteration >= onset]
    post = post[~np.isnan(post)]
    if not len(post):
        return math.nan
    norm = np.array([task.normalized_return(v) for v in post.tolist()], dtype=float)
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


def runs_of(table: pd.DataFrame, keys: list[str], cells: np.ndarray | None = None) -> list[np.ndarray]:
    """The row positions of each run of `table`, one array per distinct `keys` value (a row with a missing key is
    in none), in the order `groupby(keys, sort=True)` gives them, each in iteration order. `cells` stands in for
    a `cell` key (the cells with NaN read as ""), so the table is never copied to add one."""
    codes = []
    for key in keys:
        values = cells if key == "cell" and cells is not None else table[key].to_numpy()
        codes.append(pd.factorize(values, sort=True)[0])
    if not len(table):
        return []
    codes = np.stack(codes)
    order = np.lexsort((table["iteration"].to_numpy(dtype=float, na_value=np.nan), *codes[::-1]))
    order = order[(codes >= 0).all(axis=0)[order]]
    if not len(order):
        return []
    ordered = codes[:, order]
    return np.split(order, np.flatnonzero((ordered[:, 1:] != ordered[:, :-1]).any(axis=0)) + 1)


def cells_of(table: pd.DataFrame) -> np.ndarray:
    """The `cell` of every row, "" for a run without knobs (NaN when joined with a grid, where groupby would drop
    it)."""
    if "cell" not in table:
        return np.full(len(table), "", dtype=object)
    return table["cell"].fillna("").to_numpy(dtype=object)


def outcomes(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, method, seed, variant): failed, post-onset return, normalized return.

    Runs are read as slices of the columns scoring needs (`runs_of`), never as per-run frames: the same numbers as
    the frame-level functions above, at a fraction of the time on the method matrix."""
    rows = []
    tasks: dict[tuple[object, str], Task] = {}
    cells = cells_of(table)
    runs = runs_of(table, ["task", "cell", "method", "seed", "variant"], cells)
    columns = {c: table[c].to_numpy() for c in ("task", "method", "seed", "variant", "role", "onset_iteration",
                                                 "iterations") if c in table}
    iteration = table["iteration"].to_numpy()
    returns = table["return"].to_numpy(dtype=float, na_value=np.nan)
    diverged = (table["status"] == "diverged").to_numpy(bool)
    stops = table["diverged_at"].to_numpy(dtype=float, na_value=np.nan) if "diverged_at" in table else None
    acts = table["acts"].to_numpy() if "acts" in table else None
    metrics: dict[str, np.ndarray | None] = {}
    identity = [c for c in table.columns if c in ("task", "task_ref", "task_version") or str(c).startswith("knob_")]
    for where in runs:
        first = where[0]
        task_id, cell = columns["task"][first], cells[first]
        if (task_id, cell) not in tasks:  # one task per (task, cell), its version checked on all its rows
            mine = (columns["task"] == task_id) & (cells == cell)
            tasks[(task_id, cell)] = task_of(table.loc[mine, identity], cell)
        task = tasks[(task_id, cell)]
        gt = task.ground_truth
        if gt.metric not in metrics:
            metrics[gt.metric] = (table[gt.metric].to_numpy(dtype=float, na_value=np.nan) if gt.metric in table
                                  else None)
        values = metrics[gt.metric]
        onset, iterations = int(columns["onset_iteration"][first]), int(columns["iterations"][first])
        it, ret = iteration[where], returns[where]
        stop = float(np.nanmax(stops[where])) if stops is not None and not np.isnan(stops[where]).all() else math.nan
        gone = bool(diverged[where].any())
        value = mean_return(it, ret, stop, task.return_floor, onset, iterations)
        rows.append(
            {
                "task": f"{task_id} [{cell}]" if cell else task_id,
                "method": columns["method"][first],
                "role": columns["role"][first],
                # False: the method does not change this task's trainer, and these are the baseline's rows
                "acts": bool(acts[first]) if acts is not None else True,
                "seed": columns["seed"][first],
                "variant": columns["variant"][first],
                "failed": failed(it, gone, None if values is None else values[where], gt, onset, iterations),
                "diverged": gone,
                "post_onset_return": value,
                "normalized_return": task.normalized_return(value) if not math.isnan(value) else math.nan,
                "drawdown": drawdown(it, ret, task, onset),
            }
        )
    return pd.DataFrame(rows)
