"""`stabench paper`: every figure and table of the paper, rebuilt from raw results.

Inputs are run folders (their `metrics.parquet`); by default the committed results (`DEFAULT_RESULTS`). Outputs:
`paper/figures/*.pdf|png`, `paper/tables/*.md|csv`, and `paper/paper.md` rendered from `paper/paper.template.md`,
whose `{{table:NAME}}`, `{{value:NAME}}` and `{{text:NAME}}` placeholders are filled from the generated tables, so
no number in the text is typed by hand. The figures are the suite's own (below) and every registered task's
(`Task.figures`, drawn by the task's module); `{{text:task_sections}}` prints each task's paragraph (`Task.paper`)
with its figures. A figure's file is named by its owner and its slug, `figures/<task id or suite>_<slug>.png`
(`figure_list`), and numbered only in the rendered text, in the order the figures appear (`number_figures`).
A figure whose task is not in the results is skipped with a line saying so, never drawn empty.
The matrix's classification lives in `suite.matrix`, the plotting toolkit in `suite.figures`, what is read of the
results in `suite.paper_inputs`, and the tool tasks' split-detection study with them (`stabench.tasks.worlds`).
The results section compares like with like: the leaderboard figure and the aggregate table rank only the methods on
the common default task set, in rank bands (`suite.bands`: methods whose intervals overlap are not ordered), and the
detector figures and tables score every detector on the same runs, both from the method matrix when there is one (as
the leaderboard does); the experimental tasks are shown apart, never ranked.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
from stabench.suite import bands, fidelity, outcomes, paper_inputs, paragraphs, skill, statistics
from stabench.suite import matrix as matrix_module
from stabench.suite.api import REFERENCE_METHODS, Figure, StabenchError, Task
from stabench.suite.calibration import margin_notes
from stabench.suite.figures import ONSET_STYLE, Skip, markdown_table, mean_ci, onset_line, save, setup
from stabench.suite.registry import discover

PAPER = Path("paper")
# The default suite's quick tier, the staleness grid, and the experimental tasks' 10-seed calibration runs (a default
# task's rows come from the quick tier only: its calibration runs would repeat seeds the quick tier holds).
DEFAULT_RESULTS = [Path("results/quick"), Path("results/staleness-grid"),
                   *(Path("results/calibration") / task / "seeds-0-9"
                     for task, builtin in discover("task").items() if builtin.fields.get("experimental"))]
MATRIX = Path("results/matrix")  # `stabench run --matrix`: every stabilizer on every default task


# ---- the suite's own figures (across tasks) ------------------------------------------------------------

MAP_DIAGNOSTICS = ("entropy", "grad_norm_total", "dormant_share", "kl_k1", "kl_k2_over_k3", "clip_frac",
                   "behaviour_kl", "policy_churn", "effective_rank")


def fig_failure_map(table: pd.DataFrame, out: Path, name: str, per_run: pd.DataFrame | None = None) -> list[Path]:
    """Task x diagnostic: the detector skill score (`suite.skill`: 100 = oracle, 0 = chance) of Page-Hinkley
    on each diagnostic, the better of both directions, replayed on every stored run of the task that the track
    scores (all methods, what a detector may see; `build` passes the method matrix when there is one); blank =
    not logged or privileged."""
    import matplotlib.pyplot as plt
    import seaborn as sns
    from stabench.suite import detectors, registry
    from stabench.suite.detectors import PageHinkley, default_warmup

    cells = {}
    for task_id, rows in skill.task_slices(table):  # the rows the track would drop are not replayed
        task = registry.get_task(rows["task_ref"].iloc[0])
        budget = task.budget(rows["tier"].iloc[0])
        metrics = [m for m in MAP_DIAGNOSTICS if m in rows and rows[m].notna().any() and not detectors.hidden(m, task)]
        if not metrics:
            continue
        rules = {f"alarm/{m}|{d}": partial(PageHinkley, m, default_warmup(budget), above=d == "+", onset=budget.onset)
                 for m in metrics for d in "+-"}
        columns = detectors.replay_rules(rows, task, rules, metrics)
        bare = rows.drop(columns=[c for c in rows.columns if c.startswith("alarm/")])  # the recorded ones: not read
        scored = pd.DataFrame(skill.detector_track(bare.assign(**columns), per_run))
        for metric in metrics:
            mine = scored[scored["detector"].isin([f"{metric}|+", f"{metric}|-"])]["score"]
            cells[(task_id, metric)] = float(mine.max()) if mine.notna().any() else math.nan
    if not cells or all(math.isnan(v) for v in cells.values()):
        raise Skip("no failing run to detect")
    grid = pd.Series(cells).unstack()
    grid = grid[[c for c in MAP_DIAGNOSTICS if c in grid]]
    fig, ax = plt.subplots(figsize=(1.3 * grid.shape[1] + 4, 0.7 * grid.shape[0] + 2.5))
    sns.heatmap(grid, annot=True, fmt=".0f", cmap="RdYlGn", vmin=-50, vmax=100, center=0, ax=ax,
                cbar_kws={"label": "detector skill score (100 = oracle, 0 = chance)"})
    ax.set_xlabel("diagnostic (Page-Hinkley, better direction, every run of the task)")
    ax.set_ylabel("task")
    ax.tick_params(axis="y", rotation=0)
    ax.tick_params(axis="x", rotation=30)
    ax.set_title("Failure-mode map: how well and how early each diagnostic tells failing runs from healthy ones")
    return save(fig, out, name)


def experimental_tasks(table: pd.DataFrame) -> set[str]:
    """The ids of the table's tasks that are registered as experimental (below the calibration bar)."""
    from stabench.suite import registry

    by = "task_ref" if "task_ref" in table else "task"
    pairs = table[["task", by]].drop_duplicates("task").itertuples(index=False)
    return {task for task, ref in pairs if getattr(registry.resolve_class("task", ref), "experimental", False)}


def stabilizer_views(per_run: pd.DataFrame, experimental: set[str],
                     matrix_runs: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """What the leaderboard figure and the aggregate table show: (ranking, apart, note).

    `ranking`: the methods ranked on the common task set by the leaderboard's rule (`statistics.across_tasks`: the
    baseline's tasks; a method with runs on only some of them is left out, its number would compare tasks rather
    than methods), in rank bands (`suite.bands`: methods whose intervals overlap, directly or through a chain, share
    a band and are not ordered; 1 is the top), by band and then IQM: band, method, n_tasks, n_acts, IQM with its
    interval, P(improve) with its interval, and the failure rate of its injected runs on that set. Read from the
    method matrix (`matrix_runs`: every method on every default task) when there is one; otherwise from the run's
    own methods on its non-experimental tasks.
    `apart`: per task and method (`statistics.stabilizer_track`), the tasks left out of the ranking (the experimental
    ones), shown beside it, never mixed in. `note`: one sentence saying which set was ranked."""
    if matrix_runs is not None:
        ranked_runs = matrix_runs
        apart_runs = per_run[~per_run["task"].isin(set(matrix_runs["task"]))]
    else:
        default = per_run[~per_run["task"].isin(experimental)]
        ranked_runs = default if len(default) else per_run
        apart_runs = per_run[~per_run.index.isin(ranked_runs.index)]
    common = statistics.common_tasks(ranked_runs)
    injected = ranked_runs[(ranked_runs["variant"] == "injected") & ranked_runs["task"].isin(common)]
    failure = injected.groupby("method")["failed"].mean()
    rows = [{"method": r["method"], "n_tasks": r["n_tasks"], "n_acts": len(r["acts_on"]), "iqm": r["iqm"],
             "ci_low": r["ci_low"], "ci_high": r["ci_high"], "poi": r.get("probability_of_improvement", math.nan),
             "poi_ci_low": r.get("poi_ci_low", math.nan), "poi_ci_high": r.get("poi_ci_high", math.nan),
             "failure_rate": float(failure.get(r["method"], math.nan))}
            for r in statistics.across_tasks(ranked_runs) if r["ranked"]]
    for row, band in zip(rows, bands.rank_bands([r["iqm"] for r in rows], [r["ci_low"] for r in rows],
                                                 [r["ci_high"] for r in rows])):
        row["band"] = band if band is not None else math.nan
    columns = ["band", "method", "n_tasks", "n_acts", "iqm", "ci_low", "ci_high", "poi", "poi_ci_low", "poi_ci_high",
               "failure_rate"]
    ranking = pd.DataFrame(rows, columns=columns).sort_values(["band", "iqm", "method"],
                                                              ascending=[True, False, True])
    apart = pd.DataFrame(statistics.stabilizer_track(None, per_run=apart_runs)) if len(apart_runs) else pd.DataFrame()
    seeds = int(injected.groupby(["task", "method"])["seed"].nunique().min()) if len(injected) else 0
    if matrix_runs is not None:
        note = (f"Ranked on the {len(common)} default tasks of the method matrix (`stabench run --matrix`: every "
                f"stabilizer on every task, {seeds} seeds), so every method is compared on the same tasks and seeds")
    else:
        note = (f"No method matrix was read: the run's own methods, ranked on the {len(common)} tasks common to all "
                f"of them ({seeds} seeds or more); a method that ran on only some of them is left out")
    return ranking.reset_index(drop=True), apart, note


def ranking_table(ranking: pd.DataFrame) -> pd.DataFrame:
    """The aggregate table as a reader reads it: one formatted cell per quantity, no lists."""
    def ci(value: float, low: float, high: float, digits: int) -> str:
        return "-" if math.isnan(value) else f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"

    return pd.DataFrame({
        "band": ["-" if pd.isna(b) else str(int(b)) for b in ranking["band"]],
        "method": ranking["method"],
        "tasks": [f"{t} (acts on {a})" for t, a in zip(ranking["n_tasks"], ranking["n_acts"])],
        "IQM [95% CI]": [ci(*v, 3) for v in ranking[["iqm", "ci_low", "ci_high"]].itertuples(index=False)],
        "P(improve) [95% CI]": [ci(*v, 2) for v in ranking[["poi", "poi_ci_low", "poi_ci_high"]]
                                .itertuples(index=False)],
        "failure rate": [f"{v:.2f}" for v in ranking["failure_rate"]],
    })


def apart_table(apart: pd.DataFrame) -> pd.DataFrame:
    """The tasks kept out of the ranking, per task and method: normalized return with its interval, failure rates."""
    if apart.empty:
        return pd.DataFrame()
    return pd.DataFrame({
        "task": apart["task"], "method": apart["method"], "role": apart["role"], "seeds": apart["n_seeds"],
        "normalized return [95% CI]": [f"{v:.3f} [{lo:.3f}, {hi:.3f}]" for v, lo, hi in
                                       apart[["normalized_return", "ci_low", "ci_high"]].itertuples(index=False)],
        "failure rate": [f"{v:.2f}" for v in apart["failure_rate"]],
        "control failure rate": [f"{v:.2f}" for v in apart["control_failure_rate"]],
    })


ROLE_STYLE = {"baseline": ("C3", "o", "baseline"), "matched-fix": ("C2", "D", "matched fix"),
              "other": ("C0", "o", "other method"), "reference": ("0.45", "x", "reference (does not learn)")}


def fig_leaderboard(table: pd.DataFrame, out: Path, name: str,
                    views: tuple[pd.DataFrame, pd.DataFrame, str] | None = None) -> list[Path]:
    """Left: the ranked methods (`stabilizer_views`: the common default task set, from the method matrix when
    there is one), IQM of normalized return with stratified bootstrap 95% intervals, by rank band (the top band on
    top; every other band shaded, each named at the right: within a band the methods are not ordered). Right, apart:
    the experimental tasks, each task's methods by role (never ranked with the others)."""
    import matplotlib.pyplot as plt

    if views is None:
        views = stabilizer_views(outcomes.outcomes(table), experimental_tasks(table))
    ranking, apart, note = views
    if ranking.empty:
        raise Skip("no method ran on the whole common task set")
    ranking = ranking.iloc[::-1].reset_index(drop=True)  # the top band on top
    n_apart = apart["task"].nunique() if len(apart) else 0
    height = max(0.3 * len(ranking), 0.55 * n_apart) + 2.2
    if n_apart:
        fig, (ax, side) = plt.subplots(1, 2, figsize=(15, height), gridspec_kw={"width_ratios": [1.15, 1]})
    else:
        fig, ax = plt.subplots(figsize=(8, height))
    roles = {"baseline": "baseline", **{m: "reference" for m in REFERENCE_METHODS}}
    y = np.arange(len(ranking))
    for i, row in ranking.iterrows():
        color, marker, _ = ROLE_STYLE[roles.get(row["method"], "other")]
        ax.errorbar(row["iqm"], i, xerr=[[row["iqm"] - row["ci_low"]], [row["ci_high"] - row["iqm"]]],
                    fmt="o", ms=4, capsize=2, color=color)
    for band, members in ranking.groupby("band"):  # rows of one band are contiguous: sorted by band
        low, high = members.index.min() - 0.5, members.index.max() + 0.5
        if int(band) % 2 == 0:
            ax.axhspan(low, high, color="0.92", linewidth=0, zorder=0)
        ax.text(1.01, (low + high) / 2, f"band {int(band)}", transform=ax.get_yaxis_transform(), va="center",
                fontsize=7, color="0.35")
    base = ranking[ranking["method"] == "baseline"]
    if len(base):
        ax.axvline(float(base["iqm"].iloc[0]), color=ROLE_STYLE["baseline"][0], linestyle=":", linewidth=1,
                   label="baseline")
    ax.axvline(0, **ONSET_STYLE)
    ax.set_yticks(y)
    ax.set_yticklabels(ranking["method"])
    for label, method in zip(ax.get_yticklabels(), ranking["method"]):
        label.set_color(ROLE_STYLE[roles.get(method, "other")][0])
    ax.set_ylim(-0.7, len(ranking) - 0.3)
    n_tasks = int(ranking["n_tasks"].max())
    ax.set_xlabel(f"IQM of normalized return after onset over {n_tasks} tasks (95% stratified bootstrap CI)")
    source = "method matrix" if "of the method matrix" in note else "this run's own methods"
    ax.set_title(f"Rank bands on the common task set ({n_tasks} tasks, {source})")
    if n_apart:
        tasks = sorted(apart["task"].unique(), reverse=True)
        where = {t: i for i, t in enumerate(tasks)}
        seen = set()
        for row in apart.itertuples(index=False):
            role = row.role if row.role in ROLE_STYLE else "other"
            color, marker, label = ROLE_STYLE[role]
            yy = where[row.task]
            first = role not in seen
            seen.add(role)
            if role in ("baseline", "matched-fix"):
                side.errorbar(row.normalized_return, yy, fmt=marker, ms=5, capsize=2, color=color,
                              xerr=[[row.normalized_return - row.ci_low], [row.ci_high - row.normalized_return]],
                              label=label if first else None, zorder=3)
            else:
                side.scatter(row.normalized_return, yy, marker=marker, s=28 if role == "reference" else 14,
                             color=color, label=label if first else None, zorder=2)
            if role == "matched-fix":
                side.annotate(row.method, (row.normalized_return, yy), textcoords="offset points", xytext=(0, 6),
                              ha="center", fontsize=7, color=color)
        side.axvline(0, **ONSET_STYLE)
        side.set_yticks(range(len(tasks)))
        side.set_yticklabels(tasks)
        side.set_ylim(-0.7, len(tasks) - 0.3)
        side.set_xlabel("normalized return after onset (mean over seeds, 95% CI)")
        side.set_title("Experimental tasks, apart: each task's own methods (not ranked)")
        side.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 * 8 / height), ncol=4, frameon=False,
                    fontsize=8)
    return save(fig, out, name)


def fig_latency(table: pd.DataFrame, out: Path, name: str, per_run: pd.DataFrame | None = None,
                track: pd.DataFrame | None = None) -> list[Path]:
    """The detector track: skill score per detector and task with its 95% interval (left), and lead time on
    detected failing runs, alarm before the failure shows in the true return, as a share of the post-onset
    horizon (right; above 0 = warned before). The legend sits outside both panels. `build` passes the method
    matrix when there is one (every detector on the same runs, 10 seeds), its `per_run` outcomes and its `track`
    (`skill.detector_track`, which the tables show too)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    per_run = outcomes.outcomes(table) if per_run is None else per_run
    runs = skill.detector_runs(table, per_run)
    result = pd.DataFrame(skill.detector_track(table, per_run)) if track is None else track
    if result.empty or result["score"].isna().all():
        raise Skip("no failing run in the results")
    runs = runs[runs["lead"].notna()].assign(lead_frac=lambda r: r["lead"] / r["horizon"])
    order = (result.groupby("detector")["score"].mean().sort_values(ascending=False).index.tolist())
    tasks = sorted(result["task"].unique())
    palette = dict(zip(tasks, sns.color_palette("colorblind", len(tasks))))
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.42 * len(order) + 2.5), sharey=True)
    offsets = np.linspace(-0.3, 0.3, len(tasks)) if len(tasks) > 1 else np.zeros(1)
    for offset, task in zip(offsets, tasks):
        mine = result[result["task"] == task].set_index("detector").reindex(order)
        y = np.arange(len(order)) + offset
        axes[0].errorbar(mine["score"], y, xerr=[mine["score"] - mine["ci_low"], mine["ci_high"] - mine["score"]],
                         fmt="o", ms=4, capsize=2, color=palette[task], label=task, linewidth=0.8)
        lead = runs[runs["task"] == task]
        if len(lead):
            ly = lead["detector"].map({d: i for i, d in enumerate(order)}).to_numpy(float) + offset
            jitter = np.random.default_rng(0).uniform(-0.04, 0.04, len(ly))
            axes[1].scatter(lead["lead_frac"], ly + jitter, s=12, alpha=0.7, color=palette[task])
    axes[0].axvline(0, **ONSET_STYLE)
    axes[0].axvline(100, color="0.6", linewidth=0.8)
    axes[0].set_yticks(range(len(order)))
    axes[0].set_yticklabels(order)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("skill score (100 = oracle, 0 = chance; 95% interval)")
    axes[0].set_title("Detector skill per task")
    axes[1].axvline(0, **ONSET_STYLE)
    axes[1].set_xlabel("lead time: (failure visible in the return - first alarm) / post-onset horizon")
    axes[1].set_title("Lead time on detected failing runs (> 0: warned before)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), title="task", frameon=False)
    fig.tight_layout()
    paths = []
    for ext in ("pdf", "png"):
        path = out / "figures" / f"{name}.{ext}"
        fig.savefig(path, dpi=150, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def fig_precision_lead(table: pd.DataFrame, out: Path, name: str,
                       per_run: pd.DataFrame | None = None) -> list[Path]:
    """Per task, its paired diagnostic read as the change rules read it (z against the run's own pre-onset rows, on
    the task's side), across thresholds (`suite.tradeoff`): the precision of the runs that alarm (failing / all
    alarmed; dashed: chance, the share of failing runs) against the median lead on the failing runs it warns (> 0:
    before the failure shows in the return). Every run the detector track scores; `build` passes the method matrix
    when there is one."""
    import matplotlib.pyplot as plt
    from stabench.suite import tradeoff

    curves = tradeoff.precision_lead(table, per_run)
    if curves.empty or curves["precision"].isna().all():
        raise Skip("no failing run in the results")
    tasks = sorted(curves["task"].unique())
    cols = min(4, len(tasks))
    rows_n = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n + 0.6), squeeze=False,
                             constrained_layout=True)
    norm = plt.matplotlib.colors.LogNorm(min(tradeoff.THRESHOLDS), max(tradeoff.THRESHOLDS))
    for ax, task in zip(axes.flat, tasks):
        mine = curves[curves["task"] == task].sort_values("threshold")
        ax.plot(mine["median_lead"], mine["precision"], color="0.6", linewidth=0.8, zorder=1)
        dots = ax.scatter(mine["median_lead"], mine["precision"], c=mine["threshold"], cmap="viridis", norm=norm,
                          s=16, zorder=2)
        ax.axhline(float(mine["base_rate"].iloc[0]), color="0.4", linestyle="--", linewidth=0.8)
        ax.axvline(0, **ONSET_STYLE)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{task}\n{mine['diagnostic'].iloc[0]} ({mine['side'].iloc[0]})", fontsize=9)
        ax.set_xlabel("median lead [iterations] (> 0: warned before)", fontsize=8)
        ax.set_ylabel("precision", fontsize=8)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    fig.colorbar(dots, ax=axes.ravel().tolist(), label="threshold [healthy standard deviations]", shrink=0.6)
    fig.suptitle("Precision against lead time across thresholds, each task's paired diagnostic "
                 "(dashed: chance precision)")
    return save(fig, out, name, tight=False)


def fig_entropy(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Policy entropy over training, baseline and matched fix, every task (the shared door of failures)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    tasks = sorted(table["task"].unique())
    cols = min(3, len(tasks))
    rows_n = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.5 * cols, 3.8 * rows_n), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        rows = table[(table["task"] == task) & (table["variant"] == "injected")
                     & table["role"].isin(["baseline", "matched-fix"])]  # fmt: skip
        sns.lineplot(rows, x="iteration", y="entropy", hue="method", errorbar=mean_ci, ax=ax)
        onset_line(ax, rows)
        ax.set_title(task)
        ax.set_ylabel("policy entropy [nats]")
    for ax in list(axes.flat)[len(tasks) :]:
        ax.set_visible(False)
    return save(fig, out, name)


def fig_method_matrix(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Drawn from the matrix run, not from the results (`build` passes its cells)."""
    raise Skip("the matrix figure is drawn from the matrix run")


SUITE = "suite"  # the owner of the figures across tasks, in their files' names
SUITE_FIGURES: tuple[Figure, ...] = (
    Figure("failure-mode-map", "failure-mode map", "", fig_failure_map),
    Figure("entropy", "entropy", "", fig_entropy),
    Figure("stabilizer-leaderboard", "stabilizer leaderboard", "", fig_leaderboard),
    Figure("detection-latency", "detection latency", "", fig_latency),
    Figure("method-matrix", "failure-mode x stabilizer matrix", "", fig_method_matrix),
    Figure("precision-lead", "precision against lead time", "", fig_precision_lead),
)
SLUG = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


def task_classes() -> list[type[Task]]:
    """Every registered task's class (built-ins, tasks registered at run time, entry points)."""
    from stabench.suite import registry

    return [registry.resolve_class("task", name) for name in registry.names("task")]


def figure_file(owner: str, figure: Figure) -> str:
    """The file name (no suffix) of `owner`'s figure (a task id, or `SUITE`): `<owner>_<slug>`. A slug is lower
    case words joined by hyphens; it carries no number (the text numbers figures as they appear)."""
    if not SLUG.fullmatch(figure.name):
        raise StabenchError(f"{owner}: figure name {figure.name!r} is not a slug (lower-case words joined by '-', "
                            "no number: the paper numbers its figures in the order they appear)")
    return f"{owner}_{figure.name}"


def figure_list() -> list[tuple[str, Figure]]:
    """(file name, figure) for the suite's figures and every registered task's, in the order they are drawn."""
    figures: dict[str, Figure] = {}
    for owner, own in [(SUITE, SUITE_FIGURES), *((cls.id, cls.figures) for cls in task_classes())]:
        for figure in own:
            name = figure_file(owner, figure)
            if name in figures:
                raise StabenchError(f"{owner} has two figures named {figure.name!r}")
            figures[name] = figure
    return list(figures.items())


def number_figures(text: str) -> str:
    """Each figure of the rendered text (`![caption](figures/NAME.png)`) numbered in the order it first appears:
    its caption starts `Figure N:`."""
    numbers: dict[str, int] = {}

    def numbered(match: re.Match) -> str:
        number = numbers.setdefault(match.group(2), len(numbers) + 1)
        return f"![Figure {number}: {match.group(1)}](figures/{match.group(2)}.png)"

    return re.sub(r"!\[(.*?)\]\(figures/([^)\s]+)\.png\)", numbered, text)


def task_sections(table: pd.DataFrame, drawn: set[str], numbers: pd.DataFrame | None = None) -> str:
    """Per task in the results: its paragraph (`Task.paper`) and the figures drawn for it, default tasks first. The
    paragraph's numbers (`suite.paragraphs`) come from `numbers` for the tasks it holds (`build` passes the method
    matrix), else from `table`."""
    present = set(table["task"].unique())
    held = set(numbers["task"].unique()) if numbers is not None else set()
    classes = sorted((c for c in task_classes() if c.id in present), key=lambda c: (c.experimental, c.id))
    margins = margin_notes()  # the committed calibration's missed and thin verdicts, stated where the task is
    parts = []
    for cls in classes:
        label = " (experimental)" if cls.experimental else ""
        rows = numbers if cls.id in held else table
        text = paragraphs.fill(" ".join(cls.paper.split()), cls, rows[rows["task"] == cls.id])
        lines = [f"### {cls.id}{label}", "", text or "(no paragraph)"]
        if cls.id in margins:
            lines += ["", f"Calibration margin (results/calibration/margins.csv): {margins[cls.id]}; a verdict within "
                          "one seed of the bar can flip on another machine or on other seeds."]
        lines += [f"\n![{f.caption or f.title}](figures/{figure_file(cls.id, f)}.png)" for f in cls.figures
                  if figure_file(cls.id, f) in drawn]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


# ---- tables and text ----------------------------------------------------------------------------------

def detector_source(main: pd.DataFrame, per_run: pd.DataFrame, experimental: set[str],
                    matrix_table: pd.DataFrame | None = None,
                    matrix_runs: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """The rows the paper's detector figures and tables are scored on, their outcomes, and a sentence saying so:
    the method matrix when there is one (the leaderboard's detector rows: every detector on the same runs, every
    method on every default task), otherwise the run's own non-experimental tasks. The tasks left out are scored
    apart (`write_tables`: `best_detectors_experimental`)."""
    if matrix_table is not None:
        runs = outcomes.outcomes(matrix_table) if matrix_runs is None else matrix_runs
        seeds = int(matrix_table.groupby(["task", "method"])["seed"].nunique().min())
        return matrix_table, runs, (
            f"Scored on the method matrix: every stabilizer's runs on the {matrix_table['task'].nunique()} default "
            f"tasks, {seeds} seeds, the runs the leaderboard's detector rows are computed on")
    default = main[~main["task"].isin(experimental)]
    table = default if len(default) else main
    return table, per_run, (f"No method matrix was read: scored on this run's own runs of its "
                            f"{table['task'].nunique()} non-experimental tasks")


REFERENCE_DETECTORS = ("oracle", "injection", "method-prior")  # read no diagnostic: never "the best detector"


def _best_detectors(track: pd.DataFrame) -> pd.DataFrame:
    """Per task, the built-in detector with the highest skill score (the oracle, injection and method-prior
    references excluded) and, in `same band`, the others of its rank band (`suite.bands`: their intervals overlap its,
    directly or through a chain, so they are not ordered against it), with `method-prior`'s score on the task beside
    it (what knowing the method is worth); a task where no run failed has nothing to detect and no row."""
    if track.empty:
        return track
    track = track.dropna(subset=["score"])
    prior = track[track["detector"] == "method-prior"].set_index("task")["score"]
    track = track[~track["detector"].isin(REFERENCE_DETECTORS)]
    rows = []
    for _, group in track.groupby("task"):
        band = pd.Series(bands.rank_bands(group["score"].tolist(), group["ci_low"].tolist(),
                                          group["ci_high"].tolist()), index=group.index)
        top = group.sort_values("score", ascending=False)
        top = top[band[top.index] == 1] if (band == 1).any() else top.head(1)
        rows.append(top.iloc[0].to_dict() | {"same band": ", ".join(top["detector"].iloc[1:]) or "-"})
    best = pd.DataFrame(rows)
    best["method-prior"] = best["task"].map(prior)
    return best.sort_values("task")[["task", "detector", "diagnostic", "score", "ci_low", "ci_high", "median_lead",
                                      "false_alarm_rate", "warned_before", "same band", "method-prior"]]


def method_prior_summary(track: pd.DataFrame) -> str:
    """One sentence reading every detector against `method-prior` (the reference that knows which method ran and
    how it fares on the task's other seeds, and reads no diagnostic): its mean score, and per detector the tasks on
    which the detector's interval lies above method-prior's score."""
    if track.empty or "method-prior" not in set(track["detector"]):
        return "The method-prior reference was not scored."
    track = track.dropna(subset=["score"])
    prior = track[track["detector"] == "method-prior"].set_index("task")["score"]
    counts = []
    for name, group in track[~track["detector"].isin(REFERENCE_DETECTORS)].groupby("detector"):
        above = int((group["ci_low"].to_numpy() > group["task"].map(prior).to_numpy()).sum())
        counts.append((-above, name, f"{name} {above}"))
    n = prior.notna().sum()
    return (f"Read against method-prior, which alarms at onset on an injected run when its method's injected runs "
            f"mostly failed on the task's other seeds and reads no diagnostic (mean {prior.mean():.1f} over {n} "
            f"tasks; a detector that does not beat it has not shown that it reads the failure rather than the "
            f"method), the tasks on which a detector's 95% interval lies above method-prior's score: "
            + ", ".join(c for *_, c in sorted(counts)) + f" (of {n})")


def write_tables(table: pd.DataFrame, out: Path, per_run: pd.DataFrame | None = None,
                 views: tuple[pd.DataFrame, pd.DataFrame, str] | None = None,
                 detectors: tuple[pd.DataFrame, pd.DataFrame, str] | None = None,
                 detector_track: pd.DataFrame | None = None) -> dict[str, str]:
    """Generate every table (Markdown and CSV) and the single values the text quotes. `views`
    (`stabilizer_views`) and `detectors` (`detector_source`) say what the results section ranks and scores
    (`build` passes the method matrix's, and `detector_track`, the track on its rows, which the detector figure
    reads too); by default the run's own tasks."""
    per_run = outcomes.outcomes(table) if per_run is None else per_run
    experimental = experimental_tasks(table)
    ranking, apart, ranking_note = views or stabilizer_views(per_run, experimental)
    det_table, det_runs, detector_note = detectors or detector_source(table, per_run, experimental)
    others = table[~table["task"].isin(set(det_table["task"]))]
    tables = {
        "stabilizer_track": pd.DataFrame(statistics.stabilizer_track(table, per_run)),
        "aggregate": ranking,
        "experimental_returns": apart,
        "detector_track": (pd.DataFrame(skill.detector_track(det_table, det_runs)) if detector_track is None
                           else detector_track),
        "detector_track_experimental": (pd.DataFrame(skill.detector_track(others, per_run)) if len(others)
                                        else pd.DataFrame()),
    }
    tables["tasks"] = task_table(sorted(table["task_ref"].unique()))
    shown = {"aggregate": ranking_table(ranking), "experimental_returns": apart_table(apart)}
    rendered = {}
    for name, frame in tables.items():
        frame.to_csv(out / "tables" / f"{name}.csv", index=False)
        text = markdown_table(shown.get(name, frame))
        (out / "tables" / f"{name}.md").write_text(text)
        rendered[f"table:{name}"] = text
    stab = tables["stabilizer_track"]
    rendered["value:n_tasks"] = str(table["task"].nunique())
    rendered["value:n_runs"] = str(table.groupby(["task", "method", "seed", "variant"]).ngroups)
    rendered["value:n_seeds"] = str(int(stab["n_seeds"].min())) if len(stab) else "0"
    rendered["value:tier"] = ", ".join(sorted(table["tier"].unique()))
    base = stab[stab["role"] == "baseline"]
    fix = stab[stab["role"] == "matched-fix"]
    rendered["value:baseline_failure_mean"] = f"{base['failure_rate'].mean():.2f}" if len(base) else "n/a"
    rendered["value:control_failure_mean"] = f"{base['control_failure_rate'].mean():.2f}" if len(base) else "n/a"
    rendered["value:fix_failure_mean"] = f"{fix['failure_rate'].mean():.2f}" if len(fix) else "n/a"
    rendered["value:ranking_note"] = ranking_note
    rendered.update(importlib.import_module("stabench.tasks.worlds.tool_detection").write_tables(
        [(det_table, det_runs), (others, per_run)], out))  # the tool tasks' study (suite never imports tasks)
    rendered["value:detector_note"] = detector_note
    rendered["table:best_detectors"] = markdown_table(_best_detectors(tables["detector_track"]))
    rendered["value:method_prior_note"] = method_prior_summary(tables["detector_track"])
    rendered["table:best_detectors_experimental"] = markdown_table(
        _best_detectors(tables["detector_track_experimental"]))
    return rendered


LEADERBOARD = Path("results/leaderboard.csv")


def tuning_values(out: Path, board: Path = LEADERBOARD) -> dict[str, str]:
    """The default-vs-tuned table (`tables/tuning.md|csv`) from the leaderboard's tuned rows
    (`leaderboard.tuning_table`): per method tuned with a budget, its default's and its tuned setting's aggregate on
    the scoring seeds, the gain (only against a default from the same run), and its rank band among the methods
    tuned with the same budget (the defaults' beside)."""
    from stabench.suite import leaderboard

    rows = leaderboard.read(board) if board.is_file() else []
    frame = pd.DataFrame(leaderboard.tuning_table(rows))
    frame.to_csv(out / "tables" / "tuning.csv", index=False)
    if frame.empty:
        text = f"No tuned rows in `{board}` yet (`stabench tune`, then `stabench submit DIR --method M@tuned`).\n"
    else:
        def ci(prefix: str) -> pd.Series:
            return frame.apply(lambda t: "-" if pd.isna(t[prefix]) else
                               f"{t[prefix]:.3f} [{t[prefix + '_ci_low']:.3f}, {t[prefix + '_ci_high']:.3f}]", axis=1)

        shown = pd.DataFrame({
            "method": frame["method"], "budget": frame["budget"], "scoring seeds": frame["seeds"],
            "default setting": frame["default_setting"].replace("", "-"), "tuned setting": frame["setting"],
            "default IQM [95% CI]": ci("default"), "tuned IQM [95% CI]": ci("tuned"),
            "gain": frame.apply(lambda t: "no default in the same run" if not t["has_default"] else
                                "-" if pd.isna(t["gain"]) else f"{t['gain']:+.3f}", axis=1),
            "band (default's)": frame.apply(lambda t: "{} ({})".format(
                *("-" if pd.isna(t[k]) else int(t[k]) for k in ("band", "default_band"))), axis=1),
            "tuning seeds": frame["tuning_seeds"],
            "spent (configurations, runs, CPU-s)": frame.apply(
                lambda t: f"{t['configurations']}, {t['runs']}, {t['cpu_seconds']}", axis=1),
        })
        text = markdown_table(shown)
    (out / "tables" / "tuning.md").write_text(text)
    return {"table:tuning": text}


def task_table(refs: list[str]) -> pd.DataFrame:
    """One row per task: how it is induced, what truth says it failed, and what its docstring measured."""
    from stabench.suite import registry

    rows = []
    for ref in refs:
        task = registry.get_task(ref)
        budget = task.budget("quick")
        gt = task.ground_truth
        rule = "any post-onset value" if gt.reduce == "any" else f"mean of the last {gt.tail:.0%}"
        doc = sys.modules[type(task).__module__].__doc__ or type(task).__doc__ or ""
        summary = " ".join(doc.strip().split("\n\n")[0].split())  # the first paragraph states the mechanism
        rows.append({"task": task.id, "family": task.family, "trainer": task.trainer,
                     "quick (iterations, onset)": f"{budget.iterations}, {budget.onset}",
                     "fails when": f"{gt.metric} {'>' if gt.fails_when == 'above' else '<'} {gt.threshold:g} ({rule})",
                     "matched fix": task.matched_fix, "mechanism (as measured)": summary})
    return pd.DataFrame(rows)


TEMPLATE = "paper.template.md"


def template_path(out: Path) -> Path | None:
    """The template `render_text` fills: OUT's own if it has one (the repository's paper/ keeps it beside the
    text), else the suite's, so that `stabench paper DIR --out OUT` renders text into a fresh folder too: the
    source tree's `paper/` (a checkout or an editable install: this file is `suite/paper.py`), else the copy a
    wheel installs as data (pyproject's `data-files`: `<prefix>/share/stabench/`)."""
    import sysconfig

    candidates = [out / TEMPLATE, Path(__file__).resolve().parent.parent / "paper" / TEMPLATE,
                  Path(sysconfig.get_path("data")) / "share" / "stabench" / TEMPLATE]
    return next((c for c in candidates if c.is_file()), None)


def render_text(values: dict[str, str], out: Path) -> Path | None:
    template = template_path(out)
    if template is None:
        return None
    text = template.read_text()
    missing = sorted(set(re.findall(r"\{\{([a-z_]+:[a-z0-9_]+)\}\}", text)) - set(values))
    if missing:
        raise StabenchError(f"{template} asks for {', '.join(missing)}, which no generated table provides")
    text = number_figures(re.sub(r"\{\{([a-z_]+:[a-z0-9_]+)\}\}", lambda m: values[m.group(1)].rstrip("\n"), text))
    path = out / "paper.md"
    path.write_text("<!-- Generated by `stabench paper` from paper.template.md: edit the template. -->\n" + text)
    return path


PDF_STYLE = """
@page { size: A4; margin: 18mm 16mm; }
body { font-family: sans-serif; font-size: 9.5pt; line-height: 1.35; }
h1 { font-size: 13pt; margin-top: 1.2em; } h2 { font-size: 11pt; }
table { border-collapse: collapse; font-size: 7pt; margin: 0.6em 0; }
th, td { border: 0.5pt solid #999; padding: 1.5pt 3pt; text-align: left; vertical-align: top; }
img { max-width: 100%; } p.caption, figcaption { font-size: 8pt; color: #333; }
"""


def render_pdf(markdown_path: Path) -> Path | None:
    """paper.md -> paper.pdf with python-markdown and WeasyPrint (the `paper` extra); None if absent."""
    try:
        import markdown
        from weasyprint import HTML
    except ImportError:
        return None
    text = markdown_path.read_text()
    text = re.sub(r"\A<!--.*?-->\n---\ntitle: \"(.*?)\"\n---\n", r"# \1\n", text, flags=re.S)
    body = markdown.markdown(text, extensions=["tables"])
    html = f"<html><head><meta charset='utf-8'><style>{PDF_STYLE}</style></head><body>{body}</body></html>"
    pdf = markdown_path.with_suffix(".pdf")
    HTML(string=html, base_url=str(markdown_path.parent.resolve())).write_pdf(pdf)
    return pdf


def matrix_diagnostics(out: Path) -> tuple[str, ...]:
    """The matrix's diagnostics the paper reads beyond what scoring reads (`suite.paper_inputs`): the failure-mode
    map's, the tool tasks' split-detection study's, the metrics the fidelity table's predictions test and the
    columns the task paragraphs quote (`suite.paragraphs`)."""
    tools = importlib.import_module("stabench.tasks.worlds.tool_detection")
    path = fidelity.predictions_path(out)
    predicted = tuple(p.metric for p in fidelity.read_predictions(path)[0]) if path else ()
    return (*MAP_DIAGNOSTICS, *tools.DIAGNOSTICS, *predicted, *paragraphs.columns([c.paper for c in task_classes()]))


def build(dirs: list[Path], out: Path = PAPER, log: Callable[[str], None] | None = None,
          matrix: Path | str | None = "auto") -> list[Path]:
    """Rebuild every figure, table and the text; returns the files written. `matrix`: the folder of a
    `stabench run --matrix` run, read on its own (it repeats the default results' tasks and seeds); "auto"
    reads `MATRIX` when the paper is built from the default results (every dir one of `DEFAULT_RESULTS`),
    None reads none. Without it the matrix figure is skipped and the text says the matrix was not run."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    started = time.time()
    table = paper_inputs.load_results(dirs)
    outcomes.check_versions(table)  # refuse rows of another task version before writing anything
    (out / "figures").mkdir(parents=True, exist_ok=True)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    setup()
    written: list[Path] = []
    n_rows = len(table)
    figures = figure_list()
    # grid cells (rows with knobs) feed only the figures that ask for them, each its own task's rows (a figure
    # selects its own task anyway), so the whole table is not kept beside `main`; everything else reads default runs
    with_cells = {figure_file(owner, figure): table if owner == SUITE else table[table["task"] == owner]
                  for owner, own in [(SUITE, SUITE_FIGURES), *((cls.id, cls.figures) for cls in task_classes())]
                  for figure in own if figure.grid_cells}
    main = table[table["cell"].fillna("") == ""] if "cell" in table else table
    del table
    if matrix == "auto":
        matrix = MATRIX if dirs and all(Path(d) in DEFAULT_RESULTS for d in dirs) else None
    matrix = Path(matrix) if matrix is not None else None
    matrix_table, matrix_reason = matrix_module.load_matrix(matrix, matrix_diagnostics(out))
    cells = classes = matrix_runs = None
    if matrix_table is not None:
        matched = matrix_module.matched_fixes(matrix_table)
        matrix_runs = outcomes.outcomes(matrix_table)
        cells = matrix_module.matrix_cells(matrix_runs, matched)
        classes = matrix_module.classify(cells, matched)
    # the results section compares like with like: methods ranked on the common default task set and detectors
    # scored on the same runs, both from the matrix when there is one; the experimental tasks apart
    main_runs = outcomes.outcomes(main)
    experimental = experimental_tasks(main)
    views = stabilizer_views(main_runs, experimental, matrix_runs)
    detectors = detector_source(main, main_runs, experimental, matrix_table, matrix_runs)
    track = pd.DataFrame(skill.detector_track(detectors[0], detectors[1]))  # one scoring: a table and a figure
    paper_inputs.hand_back()
    drawn: set[str] = set()
    for number, (name, figure) in enumerate(figures, start=1):
        try:
            if figure.draw is fig_method_matrix:
                if cells is None:
                    raise Skip(f"the matrix was not run: {matrix_reason}")
                paths = matrix_module.draw_method_matrix(cells, out, name)
            elif figure.draw is fig_leaderboard:
                paths = fig_leaderboard(main, out, name, views)
            elif figure.draw is fig_latency:
                paths = fig_latency(detectors[0], out, name, detectors[1], track)
            elif figure.draw is fig_precision_lead:
                paths = fig_precision_lead(detectors[0], out, name, detectors[1])
            elif figure.draw is fig_failure_map:
                paths = fig_failure_map(detectors[0], out, name, detectors[1])
            else:
                paths = figure.draw(with_cells[name] if figure.grid_cells else main, out, name)
        except Skip as why:
            log(f"[{number:>2}/{len(figures)}] {figure.title}: skipped: {why}")
            continue
        written += paths
        drawn.add(name)
        paper_inputs.hand_back()
        log(f"[{number:>2}/{len(figures)}] {figure.title}: {paths[0].with_suffix('.{pdf,png}')}")
    values = write_tables(main, out, main_runs, views, detectors, track)
    paper_inputs.hand_back()
    values["text:task_sections"] = task_sections(main, drawn, matrix_table)
    paper_inputs.hand_back()
    values.update(tuning_values(out))
    if cells is not None and classes is not None:
        matrix_module.write_matrix_tables(cells, classes, out)
    values.update(matrix_module.matrix_values(cells, classes, matrix, matrix_reason))
    values.update(fidelity.write_fidelity(matrix_table, out, absent=f"the matrix was not run: {matrix_reason}",
                                          calibration=main[main["task"].isin(experimental_tasks(main))]))
    written += sorted((out / "tables").glob("*"))
    text = render_text(values, out)
    if text:
        written.append(text)
        pdf = render_pdf(text)
        if pdf:
            written.append(pdf)
            log(f"paper: {pdf}")
        else:
            log("paper: no PDF (install the `paper` extra: pip install -e '.[paper]')")
    log(f"paper: {len(written)} files from {n_rows} rows in {time.time() - started:.1f} s")
    return written
