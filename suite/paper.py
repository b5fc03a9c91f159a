"""`stabench paper`: every figure and table of the paper, rebuilt from raw results.

Inputs are run folders (their `metrics.parquet`); by default the committed results (`DEFAULT_RESULTS`). Outputs:
`paper/figures/*.pdf|png`, `paper/tables/*.md|csv`, and `paper/paper.md` rendered from `paper/paper.template.md`,
whose `{{table:NAME}}`, `{{value:NAME}}` and `{{text:NAME}}` placeholders are filled from the generated tables, so
no number in the text is typed by hand. The figures are the suite's own (below) and every registered task's
(`Task.figures`, drawn by the task's module); `{{text:task_sections}}` prints each task's paragraph (`Task.paper`)
with its figures. A figure whose task is not in the results is skipped with a line saying so, never drawn empty.
The matrix's classification lives in `suite.matrix`, the plotting toolkit in `suite.figures`.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from stabench.suite import matrix as matrix_module
from stabench.suite import scoring
from stabench.suite.api import Figure, StabenchError, Task
from stabench.suite.figures import ONSET_STYLE, Skip, markdown_table, onset_line, save, setup

PAPER = Path("paper")
# The default suite's quick tier, the staleness grid, and the experimental tasks' 10-seed calibration runs.
DEFAULT_RESULTS = [Path("results/quick"), Path("results/staleness-grid"),
                   *(Path("results/calibration") / task / "seeds-0-9"
                     for task in ("representation-collapse", "policy-churn", "value-cold-start", "dead-layers",
                                  "missing-critic", "rare-tool-states", "length-explosion", "inference-mismatch",
                                  "moe-routing"))]
MATRIX = Path("results/matrix")  # `stabench run --matrix`: every stabilizer on every default task


# ---- the suite's own figures (across tasks) ------------------------------------------------------------

MAP_DIAGNOSTICS = ("entropy", "grad_norm_total", "dormant_share", "kl_k1", "kl_k2_over_k3", "clip_frac",
                   "behaviour_kl", "policy_churn", "effective_rank")


def fig_failure_map(table: pd.DataFrame, out: Path) -> list[Path]:
    """Task x diagnostic: the detector skill score (`suite.scoring`: 100 = oracle, 0 = chance) of Page-Hinkley
    on each diagnostic, the better of both directions, replayed on every stored run of the task (all
    methods, what a detector may see); blank = not logged or privileged."""
    import matplotlib.pyplot as plt
    import seaborn as sns
    from stabench.suite import detectors, registry
    from stabench.suite.detectors import PageHinkley, default_warmup

    cells = {}
    frame = table.assign(cell=table["cell"].fillna("") if "cell" in table else "")
    for task_id, rows in frame.groupby("task"):
        task = registry.get_task(rows["task_ref"].iloc[0])
        budget = task.budget(rows["tier"].iloc[0])
        metrics = [m for m in MAP_DIAGNOSTICS if m in rows and rows[m].notna().any() and not detectors.hidden(m, task)]
        if not metrics:
            continue
        columns = {f"alarm/{m}|{d}": np.zeros(len(rows), bool) for m in metrics for d in "+-"}
        position = pd.Series(np.arange(len(rows)), index=rows.index)
        for _, run in rows.groupby(["method", "seed", "variant"]):
            run = run.sort_values("iteration")
            visible = detectors.visible_frame(run, task).to_dict("records")
            where = position[run.index].to_numpy()
            for metric in metrics:
                for direction in "+-":
                    det = PageHinkley(metric, default_warmup(budget), above=direction == "+")
                    columns[f"alarm/{metric}|{direction}"][where] = [det.update(r) for r in visible]
        scored = pd.DataFrame(scoring.detector_track(rows.assign(**columns)))
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
    return save(fig, out, "01_failure_mode_map")


def fig_leaderboard(table: pd.DataFrame, out: Path) -> list[Path]:
    """Interquartile mean of normalized return per method with stratified bootstrap 95% intervals."""
    import matplotlib.pyplot as plt

    agg = pd.DataFrame(scoring.across_tasks(scoring.outcomes(table))).sort_values("iqm")
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(agg) + 1.5))
    ax.errorbar(agg["iqm"], range(len(agg)), xerr=[agg["iqm"] - agg["ci_low"], agg["ci_high"] - agg["iqm"]],
                fmt="o", capsize=3)
    ax.set_yticks(range(len(agg)))
    ax.set_yticklabels([f"{m} ({n} task{'s' if n > 1 else ''})" for m, n in zip(agg["method"], agg["n_tasks"])])
    ax.set_xlabel("IQM of normalized return after onset (95% stratified bootstrap CI)")
    ax.axvline(0, **ONSET_STYLE)
    ax.set_title("Stabilizer track")
    return save(fig, out, "11_stabilizer_leaderboard")


def fig_latency(table: pd.DataFrame, out: Path) -> list[Path]:
    """The detector track: skill score per detector and task with its 95% interval (left), and lead time on
    detected failing runs, alarm before the failure shows in the true return, as a share of the post-onset
    horizon (right; above 0 = warned before). The legend sits outside both panels."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    result = pd.DataFrame(scoring.detector_track(table))
    if result.empty or result["score"].isna().all():
        raise Skip("no failing run in the results")
    runs = scoring.detector_runs(table)
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
        path = out / "figures" / f"12_detection_latency.{ext}"
        fig.savefig(path, dpi=150, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def fig_entropy(table: pd.DataFrame, out: Path) -> list[Path]:
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
        sns.lineplot(rows, x="iteration", y="entropy", hue="method", errorbar=("ci", 95), seed=0, ax=ax)
        onset_line(ax, rows)
        ax.set_title(task)
        ax.set_ylabel("policy entropy [nats]")
    for ax in list(axes.flat)[len(tasks) :]:
        ax.set_visible(False)
    return save(fig, out, "09_entropy")


def fig_method_matrix(table: pd.DataFrame, out: Path) -> list[Path]:
    """Drawn from the matrix run, not from the results (`build` passes its cells)."""
    raise Skip("the matrix figure is drawn from the matrix run")


SUITE_FIGURES: tuple[Figure, ...] = (
    Figure("01_failure_mode_map", "failure-mode map", "", fig_failure_map),
    Figure("09_entropy", "entropy", "", fig_entropy),
    Figure("11_stabilizer_leaderboard", "stabilizer leaderboard", "", fig_leaderboard),
    Figure("12_detection_latency", "detection latency", "", fig_latency),
    Figure("13_method_matrix", "failure-mode x stabilizer matrix", "", fig_method_matrix),
)


def task_classes() -> list[type[Task]]:
    """Every registered task's class (built-ins, tasks registered at run time, entry points)."""
    from stabench.suite import registry

    return [registry.resolve_class("task", name) for name in registry.names("task")]


def figure_list() -> list[Figure]:
    """The suite's figures and every registered task's, numbered by name."""
    figures = {f.name: f for f in SUITE_FIGURES}
    for cls in task_classes():
        for figure in cls.figures:
            if figure.name in figures and figures[figure.name] is not figure:
                raise StabenchError(f"two figures are named {figure.name!r} ({cls.id} and another)")
            figures[figure.name] = figure
    return [figures[name] for name in sorted(figures)]


def task_sections(table: pd.DataFrame, drawn: set[str]) -> str:
    """Per task in the results: its paragraph (`Task.paper`) and the figures drawn for it, default tasks first."""
    present = set(table["task"].unique())
    classes = sorted((c for c in task_classes() if c.id in present), key=lambda c: (c.experimental, c.id))
    parts = []
    for cls in classes:
        label = " (experimental)" if cls.experimental else ""
        lines = [f"### {cls.id}{label}", "", " ".join(cls.paper.split()) or "(no paragraph)"]
        lines += [f"\n![{f.caption or f.title}](figures/{f.name}.png)" for f in cls.figures if f.name in drawn]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


# ---- tables and text ----------------------------------------------------------------------------------

def write_tables(table: pd.DataFrame, out: Path) -> dict[str, str]:
    """Generate every table (Markdown and CSV) and the single values the text quotes."""
    result = scoring.score(table)
    tables = {
        "stabilizer_track": pd.DataFrame(result["stabilizer_track"]),
        "aggregate": pd.DataFrame(result["aggregate"]),
        "detector_track": pd.DataFrame(result["detector_track"]),
    }
    tables["tasks"] = task_table(sorted(table["task_ref"].unique()))
    rendered = {}
    for name, frame in tables.items():
        frame.to_csv(out / "tables" / f"{name}.csv", index=False)
        text = markdown_table(frame)
        (out / "tables" / f"{name}.md").write_text(text)
        rendered[f"table:{name}"] = text
    stab = tables["stabilizer_track"]
    det = tables["detector_track"]
    rendered["value:n_tasks"] = str(table["task"].nunique())
    rendered["value:n_runs"] = str(table.groupby(["task", "method", "seed", "variant"]).ngroups)
    rendered["value:n_seeds"] = str(int(stab["n_seeds"].min())) if len(stab) else "0"
    rendered["value:tier"] = ", ".join(sorted(table["tier"].unique()))
    base = stab[stab["role"] == "baseline"]
    fix = stab[stab["role"] == "matched-fix"]
    rendered["value:baseline_failure_mean"] = f"{base['failure_rate'].mean():.2f}" if len(base) else "n/a"
    rendered["value:control_failure_mean"] = f"{base['control_failure_rate'].mean():.2f}" if len(base) else "n/a"
    rendered["value:fix_failure_mean"] = f"{fix['failure_rate'].mean():.2f}" if len(fix) else "n/a"
    if len(det):
        best = det[~det["detector"].isin(["oracle", "injection"])].sort_values("score").groupby("task").tail(1)
        rendered["table:best_detectors"] = markdown_table(best[["task", "detector", "diagnostic", "score", "ci_low",
                                                           "ci_high", "median_lead", "warned_before"]])
    return rendered


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


def render_text(values: dict[str, str], out: Path) -> Path | None:
    template = out / "paper.template.md"
    if not template.is_file():
        return None
    text = template.read_text()
    missing = sorted(set(re.findall(r"\{\{([a-z_]+:[a-z0-9_]+)\}\}", text)) - set(values))
    if missing:
        raise StabenchError(f"{template} asks for {', '.join(missing)}, which no generated table provides")
    text = re.sub(r"\{\{([a-z_]+:[a-z0-9_]+)\}\}", lambda m: values[m.group(1)].rstrip("\n"), text)
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


def load_results(dirs: list[Path]) -> pd.DataFrame:
    frames = []
    for directory in dirs:
        path = directory / "metrics.parquet"
        if not path.is_file():
            raise StabenchError(f"no metrics.parquet in {directory}")
        frames.append(pd.read_parquet(path))
    return pd.concat(frames, ignore_index=True)


def build(dirs: list[Path], out: Path = PAPER, log: Callable[[str], None] | None = None,
          matrix: Path | str | None = "auto") -> list[Path]:
    """Rebuild every figure, table and the text; returns the files written. `matrix`: the folder of a
    `stabench run --matrix` run, read on its own (it repeats the default results' tasks and seeds); "auto"
    reads `MATRIX` when the paper is built from the default results (every dir one of `DEFAULT_RESULTS`),
    None reads none. Without it the matrix figure is skipped and the text says the matrix was not run."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    started = time.time()
    table = load_results(dirs)
    scoring.check_versions(table)  # refuse rows of another task version before writing anything
    (out / "figures").mkdir(parents=True, exist_ok=True)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    setup()
    written: list[Path] = []
    # grid cells (rows with knobs) feed only the figures that ask for them; everything else reads default runs
    main = table[table["cell"].fillna("") == ""] if "cell" in table else table
    if matrix == "auto":
        matrix = MATRIX if dirs and all(Path(d) in DEFAULT_RESULTS for d in dirs) else None
    matrix = Path(matrix) if matrix is not None else None
    matrix_table, matrix_reason = matrix_module.load_matrix(matrix)
    cells = classes = None
    if matrix_table is not None:
        matched = matrix_module.matched_fixes(matrix_table)
        cells = matrix_module.matrix_cells(scoring.outcomes(matrix_table), matched)
        classes = matrix_module.classify(cells, matched)
    figures = figure_list()
    drawn: set[str] = set()
    for number, figure in enumerate(figures, start=1):
        try:
            if figure.draw is fig_method_matrix:
                if cells is None:
                    raise Skip(f"the matrix was not run: {matrix_reason}")
                paths = matrix_module.draw_method_matrix(cells, out)
            else:
                paths = figure.draw(table if figure.grid_cells else main, out)
        except Skip as why:
            log(f"[{number:>2}/{len(figures)}] {figure.title}: skipped: {why}")
            continue
        written += paths
        drawn.add(figure.name)
        log(f"[{number:>2}/{len(figures)}] {figure.title}: {paths[0].with_suffix('.{pdf,png}')}")
    values = write_tables(main, out)
    values["text:task_sections"] = task_sections(main, drawn)
    if cells is not None and classes is not None:
        matrix_module.write_matrix_tables(cells, classes, out)
    values.update(matrix_module.matrix_values(cells, classes, matrix, matrix_reason))
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
    log(f"paper: {len(written)} files from {len(table)} rows in {time.time() - started:.1f} s")
    return written
