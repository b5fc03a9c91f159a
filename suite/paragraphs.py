"""A task's paragraph in the paper (`Task.paper`) with its measured numbers filled in from the runs the paper
reads, so that no result is typed into the prose. Pure functions.

A paragraph names a number by a placeholder, `{KIND:ARGS}`, ARGS separated by colons, VARIANT `injected` (the
default) or `control`:
- `{failed:METHOD[:VARIANT]}`: "k of n", the runs of METHOD on the task that failed (its ground truth);
- `{tail:COLUMN:METHOD[:VARIANT]}`: "lo-hi", the range over runs of COLUMN's mean over the ground truth's tail
  (the last `tail` share of the iterations), two decimals; one run: its value;
- `{tail_mean:COLUMN:METHOD[:VARIANT]}`: the mean over runs of that tail mean, two decimals;
- `{tail_percent:COLUMN:METHOD[:VARIANT]}`: the same as a whole percentage.
A method with no runs in the table gives "(not run)"; an unknown kind is an error, so a typo cannot reach print.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
from stabench.suite import outcomes
from stabench.suite.api import StabenchError, Task

PLACEHOLDER = re.compile(r"\{([a-z_]+):([A-Za-z0-9_:/.-]+)\}")
NOT_RUN = "(not run)"
TAIL_KINDS = ("tail", "tail_mean", "tail_percent")


def _runs(rows: pd.DataFrame, method: str, variant: str) -> pd.DataFrame:
    return rows[(rows["method"] == method) & (rows["variant"] == variant)]


def tail_means(rows: pd.DataFrame, task: Task | type[Task], column: str) -> np.ndarray:
    """Per run (seed) of `rows` (one method and variant): `column`'s mean over the ground truth's tail."""
    out = []
    for _, run in rows.groupby("seed", sort=True):
        iterations = int(run["iterations"].iloc[0])
        first = iterations - max(1, math.ceil(task.ground_truth.tail * iterations))
        out.append(float(run.loc[run["iteration"] >= first, column].astype(float).mean()))
    return np.array(out, dtype=float)


def failed_text(rows: pd.DataFrame) -> str:
    """"k of n": the runs of `rows` that failed."""
    per_run = outcomes.outcomes(rows)
    return f"{int(per_run['failed'].sum())} of {len(per_run)}" if len(per_run) else NOT_RUN


def value(kind: str, args: list[str], task: Task | type[Task], rows: pd.DataFrame) -> str:
    """The text one placeholder stands for, on `rows` (the task's runs)."""
    if kind == "failed" and len(args) in (1, 2):
        mine = _runs(rows, args[0], args[1] if len(args) == 2 else "injected")
        return failed_text(mine) if len(mine) else NOT_RUN
    if kind in TAIL_KINDS and len(args) in (2, 3):
        column, method = args[:2]
        mine = _runs(rows, method, args[2] if len(args) == 3 else "injected")
        if mine.empty or column not in mine:
            return NOT_RUN
        means = tail_means(mine, task, column)
        if kind == "tail_percent":
            return f"{100 * np.nanmean(means):.0f}%"
        if kind == "tail_mean":
            return f"{np.nanmean(means):.2f}"
        low, high = np.nanmin(means), np.nanmax(means)
        return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"
    raise StabenchError(f"{task.id}: the paragraph's placeholder {{{kind}:{':'.join(args)}}} is not one of "
                        "{failed:METHOD[:VARIANT]}, {tail:COLUMN:METHOD[:VARIANT]}, {tail_mean:...}, "
                        "{tail_percent:...}")


def fill(text: str, task: Task | type[Task], rows: pd.DataFrame) -> str:
    """`text` with every placeholder replaced by its value on `rows` (the task's runs the paper reads)."""
    rows = rows[rows["task"] == task.id] if "task" in rows else rows
    return PLACEHOLDER.sub(lambda m: value(m.group(1), m.group(2).split(":"), task, rows), text)


def columns(texts: list[str]) -> set[str]:
    """The table columns the placeholders of `texts` read (what a reader of a lean table must keep)."""
    return {m.group(2).split(":")[0] for text in texts for m in PLACEHOLDER.finditer(text)
            if m.group(1) in TAIL_KINDS}
