"""`stabench report DIR`: a short report of a user's own run, so that nobody has to rebuild (or overwrite) the
paper to see how their method did.

It writes `OUT/report.md` with PNG figures (`OUT/figures/`) and CSV tables (`OUT/tables/`):
- the run's methods (plugins and built-ins) against the baseline: IQM of normalized return and the probability
  of improvement over the baseline, each with its 95% interval (`statistics.across_tasks`), and a figure of them;
- per task: the baseline, the matched fix, the highlighted methods and the references, injected runs (normalized
  return with its interval, failure rate) beside their control runs (the method's cost on healthy training),
  and the return curves over iterations with 95% bands over seeds;
- the detector table: each detector's skill score over tasks with its interval, per task in a folded table.
The highlighted methods (`--method`, by default the run's plugin stabilizers) are bold in every table and have
their own colour and a thicker line in every figure; plugin detectors are bold too.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from stabench.suite import outcomes, registry, skill, statistics
from stabench.suite.api import REFERENCE_METHODS, StabenchError
from stabench.suite.figures import ONSET_STYLE, Skip, mean_ci, need, onset_line, save, setup

MAX_ROWS_PER_TASK = 8  # beyond this (a matrix run) a task's table keeps the baseline, the fix, yours, the references
BASE_COLOUR, FIX_COLOUR, OTHER_COLOUR = "0.15", "#0072B2", "0.55"
MINE_COLOURS = ("#D55E00", "#CC79A7", "#009E73", "#E69F00")  # colourblind-safe, apart from the fix's blue


def _ci(value: float, low: float, high: float, digits: int = 2) -> str:
    """`0.81 [0.70, 0.90]`; `-` when the value is missing."""
    if value is None or not math.isfinite(value):
        return "-"
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def _rate(value: float) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.0%}"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plugin_methods(table: pd.DataFrame) -> list[str]:
    """The run's stabilizers that are not the suite's own (a FILE.py:Class or an entry point)."""
    return sorted(m for m in table["method"].unique() if m not in registry.discover("stabilizer"))


def plugin_detectors(detectors: list[str]) -> list[str]:
    return sorted(d for d in detectors if d not in registry.discover("detector"))


def colours(highlight: list[str]) -> dict[str, str]:
    """One colour per highlighted method, never the baseline's or the fix's."""
    return {m: MINE_COLOURS[i % len(MINE_COLOURS)] for i, m in enumerate(highlight)}


# ---- sections ----------------------------------------------------------------------------------------------

def methods_section(aggregate: pd.DataFrame, highlight: list[str], acts: dict[str, list[str]],
                    n_common: int, n_tasks: int) -> str:
    """Every method of the run against the baseline, ranked ones first by IQM."""
    rows = []
    order = aggregate.assign(_r=~aggregate["ranked"]).sort_values(["_r", "iqm"], ascending=[True, False])
    for r in order.itertuples():
        mine = r.method in highlight
        kind = "plugin" if r.method not in registry.discover("stabilizer") else "built-in"
        where = acts.get(r.method, [])
        acts_on = "every task" if len(where) == n_tasks else f"{len(where)} of {_n(n_tasks, 'task')}"
        poi = _ci(getattr(r, "probability_of_improvement", math.nan), getattr(r, "poi_ci_low", math.nan),
                  getattr(r, "poi_ci_high", math.nan)) if r.method != "baseline" else "-"
        rows.append([_bold(r.method, mine), kind, acts_on, _bold(_ci(r.iqm, r.ci_low, r.ci_high), mine), poi,
                     "yes" if r.ranked else "no"])
    text = ("IQM: interquartile mean of the normalized return after onset over every (task, seed) injected run "
            "(0 = the policy frozen at onset, 1 = the task's post-onset optimum), 95% stratified bootstrap "
            "interval. P(improve): probability that a run with the method beats a baseline run on the same task. "
            f"Ranked: the method has runs on all {_n(n_common, 'task')} the baseline ran on (where it does not change "
            "a task's trainer its runs there are the baseline's; `acts on` counts the tasks where it does).\n\n")
    return text + _table(["method", "kind", "acts on", "IQM [95% CI]", "P(improve) [95% CI]", "ranked"], rows)


def task_rows(track: pd.DataFrame, highlight: list[str]) -> pd.DataFrame:
    """The methods a task's table shows: all of them, or in a large run the baseline, the matched fix, the
    highlighted ones and the references."""
    if len(track) <= MAX_ROWS_PER_TASK:
        keep = track
    else:
        keep = track[track["role"].isin(["baseline", "matched-fix"]) | track["method"].isin(highlight)
                     | track["method"].isin(REFERENCE_METHODS)]
    # the baseline first, then the highlighted methods, the matched fix, other methods, the references
    rank = [0.5 if m in highlight else statistics.ROLE_ORDER.get(role, 3)
            for m, role in zip(keep["method"], keep["role"])]
    return keep.assign(_rank=rank).sort_values(["_rank", "method"]).drop(columns="_rank")


def task_section(task: str, track: pd.DataFrame, highlight: list[str], figure: str | None, why: str) -> str:
    ref = registry.get_task(track["task_ref"].iloc[0]) if "task_ref" in track else None
    fix = ref.matched_fix if ref is not None else "-"
    shown = task_rows(track, highlight)
    rows = []
    for r in shown.itertuples():
        mine = r.method in highlight
        name = _bold(r.method, mine) + ("" if r.acts or r.method == "baseline" else " (=)")
        rows.append([name, r.role, _bold(_ci(r.normalized_return, r.ci_low, r.ci_high), mine),
                     _rate(r.failure_rate),
                     _ci(r.control_normalized_return, math.nan, math.nan), _rate(r.control_failure_rate),
                     str(r.n_seeds)])
    note = f"Matched fix: `{fix}`" + ("." if fix in set(track["method"]) else " (not in this run).")
    if len(shown) < len(track):
        note += f" {_n(len(track) - len(shown), 'other method')}: `tables/stabilizer_track.csv`."
    label = " (experimental)" if ref is not None and ref.experimental else ""
    lines = [f"### {task}{label}", "", note, ""]
    lines.append(_table(["method", "role", "normalized return, injected [95% CI]", "failure rate, injected",
                         "normalized return, control", "failure rate, control", "seeds"], rows))
    lines.append(f"![{task}: return over training](figures/{figure}.png)\n" if figure else f"(no curves: {why})\n")
    return "\n".join(lines)


def detector_section(detectors: pd.DataFrame, summary: list[dict], mine: list[str]) -> str:
    if not summary:
        return "No task of the run has a failing run, so no detector can be scored.\n"
    rows = [[_bold(s["detector"], s["detector"] in mine), "plugin" if s["detector"] in mine else "built-in",
             _bold(_ci(s["score"], s["ci_low"], s["ci_high"], 1), s["detector"] in mine), str(s["n_tasks"])]
            for s in summary]
    text = ("Skill score: 100 = the oracle, 0 = any detector blind to the outcome (chance), negative = worse; the "
            "mean over tasks with a failing run, 95% interval from a stratified bootstrap over seeds.\n\n")
    text += _table(["detector", "kind", "skill score [95% CI]", "tasks"], rows)
    per_task = [[d.task, _bold(d.detector, d.detector in mine), str(d.diagnostic),
                 _ci(d.score, d.ci_low, d.ci_high, 1), _rate(d.detection_rate), _rate(d.false_alarm_rate),
                 "-" if not math.isfinite(d.median_lead) else f"{d.median_lead:.0f}"]
                for d in detectors.itertuples()]
    text += ("\n<details><summary>Per task</summary>\n\n"
             + _table(["task", "detector", "diagnostic", "skill score [95% CI]", "detection rate",
                       "false-alarm rate", "median lead [iterations]"], per_task) + "\n</details>\n")
    return text


# ---- figures -----------------------------------------------------------------------------------------------

def draw_methods(aggregate: pd.DataFrame, highlight: list[str], out: Path) -> list[Path]:
    """IQM per method with its interval; the baseline dark, the highlighted methods in their colours."""
    import matplotlib.pyplot as plt

    agg = aggregate.assign(_r=~aggregate["ranked"]).sort_values(["_r", "iqm"], ascending=[False, True])
    palette = colours(highlight)
    fig, ax = plt.subplots(figsize=(8.5, 0.4 * len(agg) + 1.6))
    for y, r in enumerate(agg.itertuples()):
        mine = r.method in highlight
        colour = palette.get(r.method, BASE_COLOUR if r.method == "baseline" else OTHER_COLOUR)
        low, high = r.iqm - r.ci_low, r.ci_high - r.iqm
        ax.errorbar([r.iqm], [y], xerr=[[max(low, 0)], [max(high, 0)]], fmt="o", capsize=3, color=colour,
                    ms=8 if mine else 5, linewidth=2.2 if mine else 1.0)
    ax.set_yticks(range(len(agg)))
    labels = [m if ranked else f"{m} ({_n(n, 'task')}, unranked)"
              for m, ranked, n in zip(agg["method"], agg["ranked"], agg["n_tasks"])]
    ax.set_yticklabels(labels)
    unranked = int((~agg["ranked"]).sum())
    if 0 < unranked < len(agg):  # an unranked IQM covers only the tasks the method ran on: set apart
        ax.axhline(unranked - 0.5, color="0.4", linewidth=0.8)
        ax.text(1.0, unranked - 0.6, "unranked below: over its own tasks only", transform=ax.get_yaxis_transform(),
                ha="right", va="top", fontsize=7, color="0.3")
    for tick, method in zip(ax.get_yticklabels(), agg["method"]):
        if method in highlight:
            tick.set_fontweight("bold")
            tick.set_color(palette[method])
    ax.axvline(0, **ONSET_STYLE)
    ax.set_xlabel("IQM of normalized return after onset (95% CI)")
    ax.set_title("Methods of this run against the baseline")
    return save(fig, out, "methods")


def draw_curves(table: pd.DataFrame, task: str, methods: list[str], highlight: list[str], fix: str,
                out: Path, name: str) -> list[Path]:
    """Return over iterations, mean and 95% band over seeds, injected runs (left) beside control runs (right):
    the baseline dark, the matched fix blue, each highlighted method in its own colour and thicker, on top."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = need(table, task, "return")
    palette = colours(highlight)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    drawn = 0
    order = [m for m in methods if m not in highlight] + [m for m in methods if m in highlight]  # yours on top
    for method in order:
        mine = rows[rows["method"] == method]
        if mine.empty or (method != "baseline" and "acts" in mine and not mine["acts"].any()):
            continue  # a method that does not act here has the baseline's runs: one line is enough
        colour = palette.get(method, BASE_COLOUR if method == "baseline" else FIX_COLOUR if method == fix
                             else OTHER_COLOUR)
        width = 2.6 if method in highlight else 1.3
        for ax, variant in zip(axes, ("injected", "control")):
            runs = mine[mine["variant"] == variant]
            if runs["return"].notna().any():
                sns.lineplot(runs, x="iteration", y="return", errorbar=mean_ci, ax=ax, color=colour,
                             linewidth=width, err_kws={"alpha": 0.15}, label=method)
                drawn += 1
    if not drawn:
        plt.close(fig)
        raise Skip(f"task {task} has no return for these methods")
    for ax, title in zip(axes, ("injected runs (the failure switched on at onset)",
                                "control runs (the same seeds, no failure)")):
        onset_line(ax, rows)
        ax.set_title(title)
        ax.set_ylabel("true return")
        if ax.get_legend():
            ax.get_legend().remove()
    handles, labels = axes[0].get_legend_handles_labels()
    legend = fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False, fontsize=8)
    for text in legend.get_texts():
        if text.get_text() in highlight:
            text.set_fontweight("bold")
    fig.suptitle(f"{task}: true return (mean and 95% band over seeds)")
    fig.tight_layout()
    paths = []
    for ext in ("pdf", "png"):  # `figures.save`, with room for the legend outside the panels
        path = out / "figures" / f"{name}.{ext}"
        fig.savefig(path, dpi=150, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


# ---- the report ----------------------------------------------------------------------------------------------

def build(dirs: list[Path], out: Path, methods: list[str] | None = None,
          log: Callable[[str], None] | None = None) -> Path:
    """Write `out/report.md` with its figures and tables from the run folders `dirs`; returns the report's path.
    `methods`: the methods to highlight (default: the run's plugin stabilizers). Every check runs before
    anything is written."""
    from stabench.suite.results import load_tables

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    table = load_tables(dirs)
    outcomes.check_versions(table)
    if "cell" in table and (table["cell"].fillna("") != "").any():
        table = table[table["cell"].fillna("") == ""]  # a grid's cells are compared by the paper's grid figures
        if table.empty:
            raise StabenchError("the run holds only grid cells; `stabench score` scores them")
    run_methods = sorted(table["method"].unique())
    for m in methods or []:
        if m not in run_methods:
            raise StabenchError(f"method {m!r} is not in this run (it has {', '.join(run_methods)})")
    if out.exists() and not out.is_dir():
        raise StabenchError(f"--out {out} is a file, not a folder")
    highlight = list(dict.fromkeys(methods)) if methods else plugin_methods(table)

    per_run = outcomes.outcomes(table)
    aggregate = pd.DataFrame(statistics.across_tasks(per_run))
    track = pd.DataFrame(statistics.stabilizer_track(table, per_run))
    refs = table.drop_duplicates("task").set_index("task")["task_ref"]
    track["task_ref"] = track["task"].map(refs)
    acting = per_run[per_run["acts"]] if "acts" in per_run else per_run
    acts = {m: sorted(g["task"].unique()) for m, g in acting.groupby("method")}
    detectors = pd.DataFrame(skill.detector_track(table, per_run))
    runs = skill.detector_runs(table, per_run)
    summary = []
    for detector, own in runs.groupby("detector") if not runs.empty else []:
        value, low, high = skill.detector_skill(own)
        if math.isfinite(value):
            summary.append({"detector": detector, "score": value, "ci_low": low, "ci_high": high,
                            "n_tasks": int(detectors.loc[detectors["detector"] == detector, "score"].notna().sum())})
    summary.sort(key=lambda s: -s["score"])
    recorded = sorted({c.split("/", 1)[1] for c in table.columns if c.startswith("alarm/")})
    mine_detectors = plugin_detectors(recorded)

    (out / "figures").mkdir(parents=True, exist_ok=True)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    setup()
    aggregate.to_csv(out / "tables" / "methods.csv", index=False)
    track.drop(columns="task_ref").to_csv(out / "tables" / "stabilizer_track.csv", index=False)
    detectors.to_csv(out / "tables" / "detector_track.csv", index=False)

    tasks = sorted(track["task"].unique(), key=lambda t: (registry.get_task(refs[t]).experimental, t))
    tiers = ", ".join(sorted(table["tier"].unique()))
    seeds = int(per_run.groupby(["task", "method"])["seed"].nunique().min())
    mine_text = ", ".join(
        f"**{m}**" + (f" (plugin `{table.loc[table['method'] == m, 'method_ref'].iloc[0]}`)"
                      if m not in registry.discover("stabilizer") else "") for m in highlight)
    parts = [
        f"# Report: {', '.join(str(d) for d in dirs)}", "",
        f"Tier {tiers}; {_n(len(tasks), 'task')}; {_n(len(run_methods), 'method')}; at least {_n(seeds, 'seed')} "
        f"per task and method; suite {table['suite_version'].iloc[0]}. Rendered by `stabench report` from the "
        "run's raw rows.",
        "",
        (f"Highlighted: {mine_text}." if highlight else
         "No plugin method in this run: name a method with `--method` to highlight it."), "",
        "## Methods against the baseline", "",
        methods_section(aggregate, highlight, acts, len(statistics.common_tasks(per_run)), len(tasks)),
    ]
    try:
        draw_methods(aggregate, highlight, out)
        parts.append("![methods against the baseline](figures/methods.png)\n")
    except Skip as why:
        log(f"report: methods figure skipped: {why}")
    parts += ["## Per task", "",
              "Each task's baseline, its matched fix, the highlighted methods and the references: the injected "
              "runs (the failure switched on at onset) beside the control runs (the same seeds without it: a "
              "method's cost on healthy training). `(=)`: the method does not change this task's trainer, so its "
              "runs are the baseline's.", ""]
    for number, task in enumerate(tasks):
        rows = track[track["task"] == task]
        fix = registry.get_task(refs[task]).matched_fix
        curve_methods = [m for m in ("baseline", fix, *highlight) if m in set(rows["method"])]
        name = f"curves_{number:02d}_{task}"
        try:
            draw_curves(table, task, list(dict.fromkeys(curve_methods)), highlight, fix, out, name)
            figure, why = name, ""
        except Skip as reason:
            figure, why = None, str(reason)
        parts.append(task_section(task, rows, highlight, figure, why))
    parts += ["## Detectors", "", detector_section(detectors, summary, mine_detectors)]
    path = out / "report.md"
    path.write_text("<!-- Generated by `stabench report`. -->\n" + "\n".join(parts))
    log(f"report: {path} ({len(tasks)} tasks, {len(list((out / 'figures').glob('*.png')))} figures)")
    return path

