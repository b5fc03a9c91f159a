"""The failure-mode x stabilizer matrix (`stabench run --matrix`): per task and method, the paired gain over the
baseline with its interval, the failure counts, each method's class (specific, broad, narrow, harms, helps nowhere),
the heatmap and the sentences the paper quotes about it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from stabench.suite import outcomes, statistics
from stabench.suite.figures import Skip, markdown_table, save

# A gain counts as help (or harm) when its 95% interval excludes 0 AND it is at least this large (a tenth of the
# distance from the frozen policy to the optimum) or, for help, it also saves at least half of the runs from
# failing. Paired seeds make tiny float-level differences "significant".
MIN_GAIN = 0.1


def load_matrix(folder: Path | None, diagnostics: tuple[str, ...] = ()) -> tuple[pd.DataFrame | None, str]:
    """The matrix run's own table (never joined with the default results: it repeats their tasks and seeds),
    or None and the reason it is absent. Only what scoring reads and the `diagnostics` asked for
    (`suite.paper_inputs.read_lean`: the matrix is the largest table the paper reads); grid cells are no part
    of it."""
    from stabench.suite.paper_inputs import read_lean

    if folder is None:
        return None, "no matrix folder was given; the paper reads results/matrix when built from the default results"
    path = Path(folder) / "metrics.parquet"
    if not path.is_file():
        return None, f"there is no {path}; `stabench run --matrix` makes it"
    table = read_lean(path, diagnostics)
    if table.empty:
        return None, f"{path} holds no runs"
    return table, ""


def matched_fixes(table: pd.DataFrame) -> dict[str, str]:
    """Task id -> its matched fix, from the registry (the run's `task_ref` names the registered task)."""
    from stabench.suite import registry

    refs = table[["task", "task_ref"]] if "task_ref" in table else table[["task"]].assign(task_ref=table["task"])
    pairs = refs.drop_duplicates("task").itertuples(index=False)
    return {task: registry.get_task(ref).matched_fix for task, ref in pairs}


def method_order(per_run: pd.DataFrame, matched: dict[str, str]) -> list[str]:
    """Baseline first, then the tasks' matched fixes (in task order), the other methods, the references last."""
    roles = per_run.groupby("method")["role"].agg(lambda r: min(r, key=lambda x: statistics.ROLE_ORDER.get(x, 2)))
    fixes = [matched[t] for t in sorted(per_run["task"].unique()) if t in matched]

    def key(method: str) -> tuple:
        role = roles[method]
        if method == "baseline" or role == "baseline":
            return (0, 0, method)
        if role == "reference":
            return (3, 0, method)
        if method in fixes:
            return (1, fixes.index(method), method)
        return (2, 0, method)

    return sorted(roles.index, key=key)


def matrix_cells(per_run: pd.DataFrame, matched: dict[str, str]) -> pd.DataFrame:
    """One row per (task, method), injected variant: the normalized-return gain over the baseline, paired by
    seed (mean over the seeds both ran of method minus baseline), a 95% bootstrap interval of the paired
    differences (NaN from fewer than two pairs: one seed gives no interval), the failure rates (injected and
    control), whether the method acts on the task's trainer, and whether it is the task's matched fix."""
    rows = []
    for task, group in per_run.groupby("task", sort=True):
        injected = group[group["variant"] == "injected"]
        base = injected[injected["method"] == "baseline"].groupby("seed")["normalized_return"].mean()
        for method, mine in group.groupby("method", sort=False):
            inj = mine[mine["variant"] == "injected"]
            ctl = mine[mine["variant"] == "control"]
            paired = inj.groupby("seed")["normalized_return"].mean()
            diff = (paired - base.reindex(paired.index)).dropna().to_numpy(dtype=float)
            if len(diff) >= 2:
                low, high = statistics.bootstrap_mean_ci(diff)
            else:
                low = high = math.nan
            rows.append({
                "task": task, "method": method, "role": mine["role"].iloc[0],
                "acts": bool(mine["acts"].all()) if "acts" in mine else True,
                "matched": matched.get(task) == method,
                "n_pairs": len(diff),
                "gain": float(diff.mean()) if len(diff) else math.nan,
                "ci_low": low, "ci_high": high,
                "n_failed": int(inj["failed"].sum()), "n_runs": len(inj),
                "failure_rate": float(inj["failed"].mean()) if len(inj) else math.nan,
                "control_failure_rate": float(ctl["failed"].mean()) if len(ctl) else math.nan,
                "n_control_failed": int(ctl["failed"].sum()), "n_control": len(ctl),
                "normalized_return": float(inj["normalized_return"].mean()) if len(inj) else math.nan,
            })
    cells = pd.DataFrame(rows)
    if cells.empty:
        return cells
    order = {m: i for i, m in enumerate(method_order(per_run, matched))}
    return cells.sort_values(["task", "method"], key=lambda s: s.map(order) if s.name == "method" else s,
                             ignore_index=True)


def classify(cells: pd.DataFrame, matched: dict[str, str]) -> pd.DataFrame:
    """Per method (the baseline excluded): the tasks it helps (gain interval above 0, and gain >= MIN_GAIN or at
    least half of the runs saved from failing: n_failed at most the baseline's minus n_runs / 2) and
    harms (interval below 0 and gain <= -MIN_GAIN), counting only tasks where it acts, and its class: `specific`
    (helps, and only on tasks whose matched fix it is), `broad` (helps on 2+ tasks, not all of them its own),
    `narrow` (helps on one task whose matched fix it is not), `harms` (helps nowhere, harms somewhere), `helps
    nowhere`; the learners that do not learn are class `reference` (they beat a baseline that ends below the
    policy frozen at onset, which says what the baseline lost, not that not learning stabilizes)."""
    rows = []
    methods = [m for m in cells["method"].drop_duplicates() if m != "baseline"]
    for method in methods:
        theirs = cells[cells["method"] == method]
        mine = theirs[theirs["acts"]]
        saved = pd.Series(False, index=mine.index)
        if {"n_failed", "n_runs"} <= set(cells.columns):
            base = cells[cells["method"] == "baseline"].set_index("task")["n_failed"]
            saved = mine["task"].map(base) - mine["n_failed"] >= mine["n_runs"] / 2
        helps = sorted(mine.loc[(mine["ci_low"] > 0) & ((mine["gain"] >= MIN_GAIN) | saved), "task"])
        harms = sorted(mine.loc[(mine["ci_high"] < 0) & (mine["gain"] <= -MIN_GAIN), "task"])
        own = sorted(t for t, fix in matched.items() if fix == method)
        is_reference = bool((theirs["role"] == "reference").any())
        if is_reference:
            kind = "reference"
        elif helps and set(helps) <= set(own):
            kind = "specific"
        elif len(helps) >= 2:
            kind = "broad"
        elif helps:
            kind = "narrow"
        elif harms:
            kind = "harms"
        else:
            kind = "helps nowhere"
        rows.append({"method": method, "role": "reference" if is_reference else "matched-fix" if own else "other",
                     "matched fix of": ", ".join(own), "class": kind, "helps": ", ".join(helps),
                     "harms": ", ".join(harms), "acts on": int(theirs["acts"].sum())})
    return pd.DataFrame(rows, columns=["method", "role", "matched fix of", "class", "helps", "harms", "acts on"])


def _signed(value: float) -> str:
    return f"{round(value, 2) or 0.0:+.2f}"  # no "-0.00"


def _gain_text(gain: float, low: float, high: float) -> str:
    if math.isnan(gain):
        return "n/a"
    if math.isnan(low):
        return f"{_signed(gain)} [no interval]"
    return f"{_signed(gain)} [{_signed(low)}, {_signed(high)}]"


def fig_method_matrix(table: pd.DataFrame | None, out: Path, name: str, per_run: pd.DataFrame | None = None,
                      matched: dict[str, str] | None = None) -> list[Path]:
    """The matrix run only: task x stabilizer heatmap of the normalized-return gain over the baseline
    (injected variant, paired by seed), each cell annotated with the gain and the failure count; cells where
    the method does not act are grey, hatched, '='; the task's matched fix is outlined."""
    if per_run is None:
        if table is None or table.empty:
            raise Skip("the matrix was not run: no table given")
        per_run = outcomes.outcomes(table)
    if matched is None:
        matched = matched_fixes(table)
    return draw_method_matrix(matrix_cells(per_run, matched), out, name)


def draw_method_matrix(cells: pd.DataFrame, out: Path, name: str) -> list[Path]:
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.patches import Rectangle

    if cells.empty or cells["gain"].isna().all():
        raise Skip("the matrix run holds no paired injected runs")
    methods = list(cells["method"].drop_duplicates())
    tasks = sorted(cells["task"].unique())
    gain = cells.pivot(index="task", columns="method", values="gain").reindex(index=tasks, columns=methods)
    acts = cells.pivot(index="task", columns="method", values="acts").reindex(index=tasks, columns=methods)
    acts = acts.fillna(True).astype(bool)
    lookup = cells.set_index(["task", "method"])
    span = max(0.1, float(np.nanmax(np.abs(gain.where(acts).to_numpy(dtype=float)))) if acts.any().any() else 0.1)
    fig, ax = plt.subplots(figsize=(0.62 * len(methods) + 3.5, 1.05 * len(tasks) + 3.0))
    sns.heatmap(gain.where(acts), ax=ax, cmap="RdBu", center=0, vmin=-span, vmax=span, linewidths=0.5,
                linecolor="white", cbar_kws={"label": "normalized-return gain over the baseline (injected)",
                                             "shrink": 0.8})
    for i, task in enumerate(tasks):
        for j, method in enumerate(methods):
            if (task, method) not in lookup.index:
                continue
            cell = lookup.loc[(task, method)]
            count = f"{cell['n_failed']}/{cell['n_runs']}"
            if not acts.iloc[i, j]:
                ax.add_patch(Rectangle((j, i), 1, 1, facecolor="0.88", edgecolor="0.6", hatch="///", linewidth=0.3))
                ax.text(j + 0.5, i + 0.5, "=", ha="center", va="center", fontsize=11, color="0.35")
                continue
            value = cell["gain"]
            significant = cell["ci_low"] > 0 or cell["ci_high"] < 0
            dark = not math.isnan(value) and abs(value) > 0.6 * span
            shown = "n/a" if math.isnan(value) else _signed(value) + ("*" if significant else "")
            ax.text(j + 0.5, i + 0.5, f"{shown}\n{count}", ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
            if cell["matched"]:
                ax.add_patch(Rectangle((j + 0.04, i + 0.04), 0.92, 0.92, fill=False, edgecolor="black", linewidth=2.2))
    fixes = cells[cells["matched"]].set_index("task")["method"]
    ax.set_yticks(np.arange(len(tasks)) + 0.5)
    ax.set_yticklabels([f"{t}\n(fix: {fixes.get(t, '?')})" for t in tasks], rotation=0, fontsize=8)
    ax.set_xticks(np.arange(len(methods)) + 0.5)
    ax.set_xticklabels(methods, rotation=55, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_xlabel("stabilizer (baseline, matched fixes, others, references)")
    ax.set_ylabel("failure mode (task)")
    seeds = int(cells["n_runs"].max())
    ax.set_title(f"Failure mode x stabilizer: gain over the baseline (mean of paired differences, {seeds} seed"
                 f"{'s' if seeds != 1 else ''}) and failed runs\n* = 95% interval excludes 0, "
                 "outlined = matched fix, '=' = does not act (the baseline's runs)", fontsize=9)
    return save(fig, out, name)


def _names(classes: pd.DataFrame, kind: str, detail: str | None = None) -> str:
    rows = classes[classes["class"] == kind]
    return ", ".join(f"`{r['method']}` ({r[detail]})" if detail and r[detail] else f"`{r['method']}`"
                     for _, r in rows.iterrows())


def matrix_values(cells: pd.DataFrame | None, classes: pd.DataFrame | None, folder: Path | None,
                  reason: str = "") -> dict[str, str]:
    """The sentences the text quotes about the matrix, computed from its cells and classes."""
    if cells is None or classes is None or cells.empty:
        why = f"The failure-mode x stabilizer matrix was not run: {reason or 'no results'}."
        return {"value:matrix_summary": why, "value:matrix_specific": "", "value:matrix_broad": "",
                "value:matrix_harms": "", "value:matrix_wall_time": "",
                "table:matrix_classes": "(the matrix was not run)\n"}
    n_tasks, n_methods = cells["task"].nunique(), cells["method"].nunique()
    acting = cells[cells["acts"] & (cells["method"] != "baseline")]
    seeds = int(cells["n_pairs"].max())
    values = {"value:matrix_summary": (
        f"The matrix ran {n_methods} methods on {n_tasks} tasks with {seeds} paired seed{'s' if seeds != 1 else ''}"
        f" per cell at most; {len(acting)} of the {n_tasks * (n_methods - 1)} method-task pairs change the task's "
        "trainer, the others are the baseline's own runs (a method that does not act scores as its baseline)."
        + (" With one seed no gain has an interval, so none counts as significant." if seeds < 2 else ""))}
    specific = _names(classes, "specific", "helps")
    fixes = classes[classes["matched fix of"] != ""]
    silent = [f"`{r['method']}` ({r['matched fix of']})" for _, r in fixes.iterrows()
              if not set(r["matched fix of"].split(", ")) & set(filter(None, r["helps"].split(", ")))]
    values["value:matrix_specific"] = (
        (f"Specific (a significant gain only on the task whose matched fix it is): {specific}." if specific else
         "No method is specific (a significant gain only on the task whose matched fix it is).")
        + (f" Matched fixes without a significant gain on their own task: {', '.join(silent)}." if silent else ""))
    broad = _names(classes, "broad", "helps")
    narrow = _names(classes, "narrow", "helps")
    nowhere = classes[classes["class"].isin(["helps nowhere", "harms"])]
    compared = classes[classes["class"] != "reference"]
    values["value:matrix_broad"] = (
        (f"Broad (a significant gain on two or more tasks): {broad}." if broad else
         "No method is broad (a significant gain on two or more tasks).")
        + (f" Helping one task that is not its own: {narrow}." if narrow else "")
        + f" {len(nowhere)} of the {len(compared)} stabilizers help nowhere (a gain counts when its 95% interval "
        f"excludes 0 and it is at least {MIN_GAIN:g} or saves half of the runs from failing).")
    harms = [f"`{r['method']}` ({r['harms']})" for _, r in compared.iterrows() if r["harms"]]
    values["value:matrix_harms"] = (f"Harming (gain interval below 0, by at least {MIN_GAIN:g}): {', '.join(harms)}."
                                    if harms else
                                    "No method significantly harms any task it acts on.")
    values["value:matrix_wall_time"] = matrix_wall_time(folder)
    values["table:matrix_classes"] = markdown_table(classes)
    return values


def matrix_wall_time(folder: Path | None) -> str:
    """Trial time summed from trials.csv, wall time from manifest.json's `wall_seconds` if recorded."""
    import json

    if folder is None:
        return "Wall time not recorded."
    parts = []
    trials = Path(folder) / "trials.csv"
    if trials.is_file():
        frame = pd.read_csv(trials)
        if "status" in frame:  # identities are copies of the baseline's runs, not trials that ran
            frame = frame[frame["status"] != "identity"]
        if "seconds" in frame and len(frame):
            parts.append(f"{len(frame)} trials took {_duration(frame['seconds'].sum())} of trial time in all")
    wall, sessions = None, []
    manifest = Path(folder) / "manifest.json"
    if manifest.is_file():
        try:
            recorded = json.loads(manifest.read_text())
            wall, sessions = recorded.get("wall_seconds"), recorded.get("sessions") or []
        except (ValueError, AttributeError):
            wall = None
    grown = f" over {len(sessions)} sessions (tasks added with `--extend`)" if len(sessions) > 1 else ""
    parts.append(f"{_duration(float(wall))} of wall time{grown}" if wall is not None
                 else "wall time not recorded in the run folder")
    return "The matrix: " + "; ".join(parts) + "."


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def write_matrix_tables(cells: pd.DataFrame, classes: pd.DataFrame, out: Path) -> None:
    """tables/matrix.md|csv (one row per task and method) and tables/matrix_classes.md|csv."""
    cells.to_csv(out / "tables" / "matrix.csv", index=False)
    shown = pd.DataFrame({
        "task": cells["task"], "method": cells["method"], "role": cells["role"],
        "acts": cells["acts"].map({True: "yes", False: "no (= baseline)"}),
        "gain [95% CI]": [_gain_text(g, lo, hi) for g, lo, hi in zip(cells["gain"], cells["ci_low"], cells["ci_high"])],
        "failure rate": [f"{f}/{n}" for f, n in zip(cells["n_failed"], cells["n_runs"])],
        "control failure rate": [f"{f}/{n}" if n else ""
                                 for f, n in zip(cells["n_control_failed"], cells["n_control"])],
    })
    (out / "tables" / "matrix.md").write_text(markdown_table(shown))
    classes.to_csv(out / "tables" / "matrix_classes.csv", index=False)
    (out / "tables" / "matrix_classes.md").write_text(markdown_table(classes))
