"""The plotting toolkit task figures and the paper share: seaborn set-up, saving, onset lines, and the panels
several tasks draw (one line per run kind with 95% bands over seeds, a gap against return). A task's figure
(`stabench.Figure`) calls these; a figure that cannot be drawn from the results raises `Skip` with the reason.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from stabench.suite import outcomes

ONSET_STYLE = {"color": "0.25", "linestyle": "--", "linewidth": 1.0}
BOOTSTRAP_DRAWS, BOOTSTRAP_LEVEL = 1000, 95  # seaborn's n_boot and ("ci", 95)


def mean_ci(values: pd.Series) -> tuple[float, float]:
    """The 95% band of a line plot (`errorbar=mean_ci`): seaborn's `errorbar=mean_ci`, the percentile
    interval of 1,000 bootstrap means drawn from `np.random.default_rng(0)`, with every resample drawn and averaged
    at once. Seaborn draws and averages them one numpy call at a time, which was most of the paper's time; the draws,
    the means and the interval are the same numbers."""
    x = np.asarray(values)
    mean = np.nanmean if np.isnan(np.sum(np.column_stack([x]))) else np.mean  # seaborn's switch on missing values
    draws = np.random.default_rng(0).integers(0, len(x), (BOOTSTRAP_DRAWS, len(x)), dtype=np.intp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a resample of missing values only: NaN, as seaborn's
        means = mean(x[draws], axis=1)
    edge = (100 - BOOTSTRAP_LEVEL) / 2
    low, high = np.nanpercentile(means, (edge, 100 - edge))
    return low, high


def setup() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    sns.set_theme(style="whitegrid", palette="colorblind", context="paper", font_scale=1.1)


def save(fig, out: Path, name: str, tight: bool = True) -> list[Path]:
    """Write the figure as figures/NAME.pdf and .png and close it; `tight`: lay it out first (not with a figure-wide
    colorbar, which places itself)."""
    if tight:
        fig.tight_layout()
    paths = []
    for ext in ("pdf", "png"):
        path = out / "figures" / f"{name}.{ext}"
        fig.savefig(path, dpi=150)
        paths.append(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths


def runs(table: pd.DataFrame, task: str) -> pd.DataFrame:
    return table[table["task"] == task]


def onset_line(ax, rows: pd.DataFrame, x: str = "iteration") -> None:
    first = rows[rows["phase"] == "post-onset"]
    if len(first):
        ax.axvline(first[x].min(), label="onset", **ONSET_STYLE)


class Skip(Exception):
    """A figure that cannot be drawn from these results; the reason is printed."""


def need(table: pd.DataFrame, task: str, *columns: str) -> pd.DataFrame:
    rows = runs(table, task)
    if rows.empty:
        raise Skip(f"task {task} is not in the results")
    missing = [c for c in columns if c not in rows or rows[c].isna().all()]
    if missing:
        raise Skip(f"task {task} has no {', '.join(missing)} in the results")
    return rows



def side_by_side(rows: pd.DataFrame, panels: list[tuple[str, str]], hue: str, title: str, out: Path,
                  name: str) -> list[Path]:
    """One line panel per (column, label), the runs coloured by `hue`, mean and 95% CI over seeds."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4))
    for ax, (column, label) in zip(axes, panels):
        sns.lineplot(rows, x="iteration", y=column, hue=hue, errorbar=mean_ci, ax=ax)
        onset_line(ax, rows)
        ax.set_ylabel(label)
    fig.suptitle(f"{title} (mean, 95% CI over seeds)")
    return save(fig, out, name)


def fix_against_baseline(table: pd.DataFrame, task: str, panels: list[tuple[str, str]], out: Path,
                          name: str) -> list[Path]:
    """Side-by-side panels of the baseline's and the matched fix's runs, injected and control, one line each."""
    rows = need(table, task, *(column for column, _ in panels))
    rows = rows[rows["role"].isin(["baseline", "matched-fix"])]
    rows = rows.assign(run=rows["method"] + " (" + rows["variant"] + ")")
    return side_by_side(rows, panels, "run", task, out, name)



def gap_against_return(rows: pd.DataFrame, column: str, label: str, out: Path, name: str) -> list[Path]:
    """Left: the gap `column` over iterations (injected runs of every method). Right: one point per run, the
    gap's post-onset mean against the normalized post-onset return, controls included (their gap is 0)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = rows[~rows["method"].isin(["no-update", "frozen-at-onset"])]
    task = rows["task"].iloc[0]
    per_run = outcomes.outcomes(rows)
    post = rows[rows["phase"] == "post-onset"]
    gap = post.groupby(["method", "seed", "variant"])[column].mean().rename("gap")
    per_run = per_run.join(gap, on=["method", "seed", "variant"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    injected = rows[rows["variant"] == "injected"]
    sns.lineplot(injected, x="iteration", y=column, hue="method", errorbar=mean_ci, ax=axes[0])
    onset_line(axes[0], injected)
    axes[0].set_ylabel(label)
    axes[0].set_title(f"{task}, injected runs (mean, 95% CI over seeds)")
    sns.scatterplot(per_run, x="gap", y="normalized_return", hue="method", style="variant", ax=axes[1], s=30)
    axes[1].axhline(0, **ONSET_STYLE)
    axes[1].set_xlabel(f"{label}, post-onset mean")
    axes[1].set_ylabel("normalized post-onset return")
    axes[1].set_title("one point per run (0 = frozen at onset, 1 = the control)")
    axes[1].legend(fontsize=7, loc="lower left")
    return save(fig, out, name)



def lines(rows: pd.DataFrame, column: str, label: str, out: Path, name: str, log: bool = False) -> list[Path]:
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = rows[(rows["variant"] == "injected") & rows["role"].isin(["baseline", "matched-fix"])]
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(rows, x="iteration", y=column, hue="method", errorbar=mean_ci, ax=ax)
    onset_line(ax, rows)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(label)
    ax.set_title(f"{rows['task'].iloc[0]} (mean, 95% CI over seeds)")
    return save(fig, out, name)


def markdown_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "(no rows)\n"

    def cell(v: object) -> str:
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"
