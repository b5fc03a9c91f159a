"""`stabench paper`: every figure and table of the paper, rebuilt from raw results.

Inputs are run folders (their `metrics.parquet`); by default the committed quick-tier results in
`results/quick/`. Outputs: `paper/figures/*.pdf|png`, `paper/tables/*.md|csv`, and `paper/paper.md`
rendered from `paper/paper.template.md`, whose `{{table:NAME}}` and `{{value:NAME}}` placeholders are
filled from the generated tables, so no number in the text is typed by hand. A figure whose task is not
in the results is skipped with a line saying so, never drawn empty.
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
from stabench.suite import scoring
from stabench.suite.api import StabenchError

PAPER = Path("paper")
# The default suite's quick tier, the staleness grid, and the experimental tasks' 10-seed calibration runs.
DEFAULT_RESULTS = [Path("results/quick"), Path("results/staleness-grid"),
                   *(Path("results/calibration") / task / "seeds-0-9"
                     for task in ("representation-collapse", "policy-churn", "value-cold-start", "dead-layers",
                                  "missing-critic", "rare-tool-states", "length-explosion", "inference-mismatch",
                                  "moe-routing"))]
MATRIX = Path("results/matrix")  # `stabench run --matrix`: every stabilizer on every default task
ONSET_STYLE = {"color": "0.25", "linestyle": "--", "linewidth": 1.0}


def _setup() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    sns.set_theme(style="whitegrid", palette="colorblind", context="paper", font_scale=1.1)


def _save(fig, out: Path, name: str) -> list[Path]:
    fig.tight_layout()
    paths = []
    for ext in ("pdf", "png"):
        path = out / "figures" / f"{name}.{ext}"
        fig.savefig(path, dpi=150)
        paths.append(path)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths


def _runs(table: pd.DataFrame, task: str) -> pd.DataFrame:
    return table[table["task"] == task]


def _onset(ax, rows: pd.DataFrame, x: str = "iteration") -> None:
    first = rows[rows["phase"] == "post-onset"]
    if len(first):
        ax.axvline(first[x].min(), label="onset", **ONSET_STYLE)


class Skip(Exception):
    """A figure that cannot be drawn from these results; the reason is printed."""


def _need(table: pd.DataFrame, task: str, *columns: str) -> pd.DataFrame:
    rows = _runs(table, task)
    if rows.empty:
        raise Skip(f"task {task} is not in the results")
    missing = [c for c in columns if c not in rows or rows[c].isna().all()]
    if missing:
        raise Skip(f"task {task} has no {', '.join(missing)} in the results")
    return rows


# ---- figures ------------------------------------------------------------------------------------------

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
    return _save(fig, out, "01_failure_mode_map")


def fig_kl_estimators(table: pd.DataFrame, out: Path) -> list[Path]:
    """Estimated KL (k1, k2, k3, batch means per token) against the exact per-token KL (summed over the
    vocabulary at the sampled prefixes), baseline and the matched fix."""
    import matplotlib.pyplot as plt

    rows = _need(table, "kl-estimator-bias", "kl_full_vocab", "kl_k1", "kl_k2", "kl_k3")
    rows = rows[rows["variant"] == "injected"]
    methods = [m for m in ("baseline", "kl-max") if m in set(rows["method"])]
    fig, axes = plt.subplots(1, len(methods), figsize=(6 * len(methods), 4), sharey=True, squeeze=False)
    for ax, method in zip(axes[0], methods):
        mine = rows[rows["method"] == method].groupby("iteration")
        for column, label in (("kl_full_vocab", "exact (full vocabulary)"), ("kl_k1", "k1"), ("kl_k2", "k2"),
                              ("kl_k3", "k3")):
            mean = mine[column].mean()
            ax.plot(mean.index, mean.values, label=label, linewidth=2.2 if column == "kl_full_vocab" else 1.2)
        _onset(ax, rows)
        ax.set_yscale("log")
        ax.set_title(f"{method} (mean over seeds)")
        ax.set_xlabel("iteration")
    axes[0][0].set_ylabel("KL(policy || reference) per token [nats]")
    axes[0][-1].legend(loc="upper left")
    return _save(fig, out, "02_kl_estimators")


def fig_grad_heatmap(table: pd.DataFrame, out: Path) -> list[Path]:
    """Per-layer gradient norm (layer x iteration), baseline seed 0, injected beside control."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = _need(table, "dead-layers", "grad_norm_total")
    rows = rows[(rows["method"] == "baseline") & (rows["seed"] == rows["seed"].min())]
    layers = sorted(c for c in rows.columns if c.startswith("grad_norm/") and rows[c].notna().any())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, variant in zip(axes, ("control", "injected")):
        mine = rows[rows["variant"] == variant].set_index("iteration")[layers]
        data = np.log10(mine.T.clip(lower=1e-8))
        sns.heatmap(data, ax=ax, cmap="magma", vmin=-4, vmax=5,
                    cbar_kws={"label": "log10 gradient norm"}, xticklabels=5)
        onset = int(rows["onset_iteration"].iloc[0])
        ax.axvline(onset, color="white", linestyle="--", linewidth=1.2)
        ax.set_title(f"{variant}: onset (dashed) at iteration {onset}")
        ax.set_xlabel("iteration")
    axes[0].set_ylabel("layer (input to output)")
    axes[0].set_yticklabels([c.split("/")[1] for c in layers], rotation=0)
    return _save(fig, out, "03_layer_gradient_heatmap")


def fig_spectrum(table: pd.DataFrame, out: Path) -> list[Path]:
    """Effective rank over time and the final singular-value spectrum, with and without the regularizer."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = _need(table, "representation-collapse", "effective_rank")
    rows = rows[rows["variant"] == "injected"]
    methods = [m for m in ("baseline", "isotropic-gaussian") if m in set(rows["method"])]
    sv = sorted(c for c in rows.columns if c.startswith("sv/") and rows[c].notna().any())
    fig, axes = plt.subplots(1, 2 if sv else 1, figsize=(12 if sv else 6, 4), squeeze=False)
    sns.lineplot(rows[rows["method"].isin(methods)], x="iteration", y="effective_rank", hue="method",
                 errorbar=("ci", 95), seed=0, ax=axes[0][0])
    _onset(axes[0][0], rows)
    axes[0][0].set_ylabel("effective rank of the features")
    axes[0][0].set_title("Effective rank (mean, 95% CI over seeds)")
    if sv:
        last = rows[rows["iteration"] == rows["iteration"].max()]
        for method in methods:
            spectrum = last[last["method"] == method][sv].mean()
            axes[0][1].plot(range(1, len(sv) + 1), spectrum.values, marker="o", label=method)
        axes[0][1].set_yscale("log")
        axes[0][1].set_xlabel("singular value index")
        axes[0][1].set_ylabel("normalized singular value")
        axes[0][1].set_title("Spectrum at the last iteration")
        axes[0][1].legend()
    return _save(fig, out, "04_spectrum_effective_rank")


def fig_pg_variance(table: pd.DataFrame, out: Path) -> list[Path]:
    rows = _need(table, "missing-critic", "grad_var")
    return _lines(rows, "grad_var", "policy-gradient variance across minibatches", out, "05_pg_variance",
                  log=True)


def _side_by_side(rows: pd.DataFrame, panels: list[tuple[str, str]], hue: str, title: str, out: Path,
                  name: str) -> list[Path]:
    """One line panel per (column, label), the runs coloured by `hue`, mean and 95% CI over seeds."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4))
    for ax, (column, label) in zip(axes, panels):
        sns.lineplot(rows, x="iteration", y=column, hue=hue, errorbar=("ci", 95), seed=0, ax=ax)
        _onset(ax, rows)
        ax.set_ylabel(label)
    fig.suptitle(f"{title} (mean, 95% CI over seeds)")
    return _save(fig, out, name)


def _fix_against_baseline(table: pd.DataFrame, task: str, panels: list[tuple[str, str]], out: Path,
                          name: str) -> list[Path]:
    """Side-by-side panels of the baseline's and the matched fix's runs, injected and control, one line each."""
    rows = _need(table, task, *(column for column, _ in panels))
    rows = rows[rows["role"].isin(["baseline", "matched-fix"])]
    rows = rows.assign(run=rows["method"] + " (" + rows["variant"] + ")")
    return _side_by_side(rows, panels, "run", task, out, name)


def fig_length(table: pd.DataFrame, out: Path) -> list[Path]:
    """Length beside exact gold accuracy: chains that grow without accuracy gain are the failure."""
    rows = _need(table, "length-explosion", "length_mean", "gt_accuracy")
    rows = rows[(rows["variant"] == "injected") & rows["role"].isin(["baseline", "matched-fix"])]
    panels = [("length_mean", "mean answer length [tokens]"), ("gt_accuracy", "exact gold accuracy")]
    return _side_by_side(rows, panels, "method", "length-explosion, injected runs", out, "06_length_accuracy")


def fig_staleness(table: pd.DataFrame, out: Path) -> list[Path]:
    """The staleness grid: return kept (injected / control) over envs x epochs, one panel per lag."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = _need(table, "parallel-staleness")
    knobs = ["knob_num_envs", "knob_epochs", "knob_lag"]
    if any(k not in rows for k in knobs) or rows[knobs].drop_duplicates().shape[0] < 2:
        raise Skip("the results hold no staleness grid (run `stabench run --grid staleness`)")
    rows = rows[rows["method"] == "baseline"]
    per_run = scoring.outcomes(rows)
    cells = rows.groupby("cell")[knobs].first()
    per_run["cell"] = per_run["task"].str.extract(r"\[(.*)\]")[0]
    per_run = per_run.join(cells, on="cell")
    pivot = per_run.pivot_table(index=["cell", "seed", *knobs], columns="variant", values="post_onset_return")
    pivot["kept"] = pivot["injected"] / pivot["control"]
    data = pivot.reset_index()
    lags = sorted(data["knob_lag"].unique())
    fig, axes = plt.subplots(1, len(lags), figsize=(5 * len(lags), 4), squeeze=False)
    for ax, lag in zip(axes[0], lags):
        grid = data[data["knob_lag"] == lag].pivot_table(index="knob_num_envs", columns="knob_epochs", values="kept")
        sns.heatmap(grid, annot=True, fmt=".2f", cmap="viridis", vmin=0, vmax=1.2, ax=ax,
                    cbar_kws={"label": "return kept (injected / control)"})
        ax.set_title(f"actors lag {lag} updates (mean over seeds)")
        ax.set_xlabel("epochs of reuse")
        ax.set_ylabel("parallel environments (batch fixed)")
    return _save(fig, out, "07_staleness_grid")


def fig_churn(table: pd.DataFrame, out: Path) -> list[Path]:
    rows = _need(table, "policy-churn", "policy_churn")
    return _lines(rows, "policy_churn", "policy churn on held-out states (share per update)", out, "08_policy_churn")


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
                     & table["role"].isin(["baseline", "matched-fix"])]
        sns.lineplot(rows, x="iteration", y="entropy", hue="method", errorbar=("ci", 95), seed=0, ax=ax)
        _onset(ax, rows)
        ax.set_title(task)
        ax.set_ylabel("policy entropy [nats]")
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    return _save(fig, out, "09_entropy")


def fig_tool_ratios(table: pd.DataFrame, out: Path) -> list[Path]:
    rows = _need(table, "rare-tool-states", "ratio_p99_tool", "ratio_p99_text")
    return _lines(rows, "ratio_p99_tool", "importance-ratio p99 in tool states", out, "10_tool_ratio_tails")


def fig_leaderboard(table: pd.DataFrame, out: Path) -> list[Path]:
    """Interquartile mean of normalized return per method with stratified bootstrap 95% intervals."""
    import matplotlib.pyplot as plt

    agg = pd.DataFrame(scoring.aggregate(scoring.outcomes(table))).sort_values("iqm")
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(agg) + 1.5))
    ax.errorbar(agg["iqm"], range(len(agg)), xerr=[agg["iqm"] - agg["ci_low"], agg["ci_high"] - agg["iqm"]],
                fmt="o", capsize=3)
    ax.set_yticks(range(len(agg)))
    ax.set_yticklabels([f"{m} ({n} task{'s' if n > 1 else ''})" for m, n in zip(agg["method"], agg["n_tasks"])])
    ax.set_xlabel("IQM of normalized return after onset (95% stratified bootstrap CI)")
    ax.axvline(0, **ONSET_STYLE)
    ax.set_title("Stabilizer track")
    return _save(fig, out, "11_stabilizer_leaderboard")


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


def _gap_against_return(rows: pd.DataFrame, column: str, label: str, out: Path, name: str) -> list[Path]:
    """Left: the gap `column` over iterations (injected runs of every method). Right: one point per run, the
    gap's post-onset mean against the normalized post-onset return, controls included (their gap is 0)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = rows[~rows["method"].isin(["no-update", "frozen-at-onset"])]
    task = rows["task"].iloc[0]
    per_run = scoring.outcomes(rows)
    post = rows[rows["phase"] == "post-onset"]
    gap = post.groupby(["method", "seed", "variant"])[column].mean().rename("gap")
    per_run = per_run.join(gap, on=["method", "seed", "variant"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    injected = rows[rows["variant"] == "injected"]
    sns.lineplot(injected, x="iteration", y=column, hue="method", errorbar=("ci", 95), seed=0, ax=axes[0])
    _onset(axes[0], injected)
    axes[0].set_ylabel(label)
    axes[0].set_title(f"{task}, injected runs (mean, 95% CI over seeds)")
    sns.scatterplot(per_run, x="gap", y="normalized_return", hue="method", style="variant", ax=axes[1], s=30)
    axes[1].axhline(0, **ONSET_STYLE)
    axes[1].set_xlabel(f"{label}, post-onset mean")
    axes[1].set_ylabel("normalized post-onset return")
    axes[1].set_title("one point per run (0 = frozen at onset, 1 = the control)")
    axes[1].legend(fontsize=7, loc="lower left")
    return _save(fig, out, name)


def fig_degenerate(table: pd.DataFrame, out: Path) -> list[Path]:
    """Held-out accuracy beside the policy's KL to the warm start: the silent groups leave the KL in charge."""
    panels = [("heldout_accuracy", "exact held-out accuracy (new rule)"),
              ("full_vocab_kl", "per-token KL(pi || warm start)")]
    return _fix_against_baseline(table, "degenerate-comparisons", panels, out, "14_degenerate_comparisons")


def fig_shortcuts(table: pd.DataFrame, out: Path) -> list[Path]:
    """Held-out accuracy beside the shortcut's rate: lucky successes on impossible problems teach the shortcut."""
    rows = _need(table, "hard-sample-shortcuts", "heldout_accuracy", "shortcut_rate")
    rows = rows[(rows["role"].isin(["baseline", "matched-fix"]) | (rows["method"] == "variance-filter"))]
    rows = rows[(rows["variant"] == "injected") | (rows["method"] == "baseline")]
    rows = rows.assign(run=rows["method"] + " (" + rows["variant"] + ")")
    panels = [("heldout_accuracy", "exact held-out accuracy (new rule)"),
              ("shortcut_rate", "share of answers copying a prompt digit")]
    return _side_by_side(rows, panels, "run", "hard-sample-shortcuts", out, "17_hard_sample_shortcuts")


def fig_calibration(table: pd.DataFrame, out: Path) -> list[Path]:
    """Stated confidence beside the chance of being right: a binary reward leaves the confidence where it was."""
    panels = [("heldout_confidence", "mean stated confidence"),
              ("heldout_accuracy", "chance of being right (accuracy)"),
              ("heldout_brier", "Brier gap (ground truth)")]
    return _fix_against_baseline(table, "calibration-collapse", panels, out, "18_calibration_collapse")


def fig_plasticity(table: pd.DataFrame, out: Path) -> list[Path]:
    """Held-out accuracy beside the drift from the warm start: the drifted policy cannot learn the new rule."""
    panels = [("heldout_accuracy", "exact held-out accuracy (new rule from the shift)"),
              ("full_vocab_kl", "per-token KL(pi || warm start)"),
              ("all_wrong_share", "share of groups with no correct answer")]
    return _fix_against_baseline(table, "plasticity-loss", panels, out, "19_plasticity_loss")


def fig_reward_model_drift(table: pd.DataFrame, out: Path) -> list[Path]:
    """Held-out accuracy beside how well the reward model orders and fits the current samples."""
    panels = [("heldout_accuracy", "exact held-out accuracy (new rule)"),
              ("rm_pair_accuracy", "RM orders within-group pairs as gold does"),
              ("rm_fit_error", "RM residual on its own labels")]
    return _fix_against_baseline(table, "reward-model-drift", panels, out, "20_reward_model_drift")


def fig_inference_mismatch(table: pd.DataFrame, out: Path) -> list[Path]:
    rows = _need(table, "inference-mismatch", "engine_kl")
    return _gap_against_return(rows, "engine_kl", "training-inference KL E_mu[log mu - log pi_old]", out,
                               "15_inference_mismatch")


def fig_moe_routing(table: pd.DataFrame, out: Path) -> list[Path]:
    rows = _need(table, "moe-routing", "flip_engine")
    return _gap_against_return(rows, "flip_engine", "share of routes flipped, engine vs learner", out,
                               "16_moe_routing")


def _lines(rows: pd.DataFrame, column: str, label: str, out: Path, name: str, log: bool = False) -> list[Path]:
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = rows[(rows["variant"] == "injected") & rows["role"].isin(["baseline", "matched-fix"])]
    fig, ax = plt.subplots(figsize=(7, 4))
    sns.lineplot(rows, x="iteration", y=column, hue="method", errorbar=("ci", 95), seed=0, ax=ax)
    _onset(ax, rows)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(label)
    ax.set_title(f"{rows['task'].iloc[0]} (mean, 95% CI over seeds)")
    return _save(fig, out, name)


# ---- the failure-mode x stabilizer matrix (`stabench run --matrix`) ------------------------------------

ROLE_ORDER = {"baseline": 0, "matched-fix": 1, "other": 2, "reference": 3}
# A gain counts as help (or harm) when its 95% interval excludes 0 AND it is at least this large (a tenth of the
# distance from the frozen policy to the optimum) or, for help, it also saves at least half of the runs from
# failing. Paired seeds make tiny float-level differences "significant".
MIN_GAIN = 0.1


def load_matrix(folder: Path | None) -> tuple[pd.DataFrame | None, str]:
    """The matrix run's own table (never joined with the default results: it repeats their tasks and seeds),
    or None and the reason it is absent."""
    if folder is None:
        return None, "no matrix folder was given; the paper reads results/matrix when built from the default results"
    path = Path(folder) / "metrics.parquet"
    if not path.is_file():
        return None, f"there is no {path}; `stabench run --matrix` makes it"
    table = pd.read_parquet(path)
    if "cell" in table:  # grid cells are no part of the matrix
        table = table[table["cell"].fillna("") == ""]
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
    roles = per_run.groupby("method")["role"].agg(lambda r: min(r, key=lambda x: ROLE_ORDER.get(x, 2)))
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
                low, high = scoring.bootstrap_mean_ci(diff)
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


def fig_method_matrix(table: pd.DataFrame | None, out: Path, per_run: pd.DataFrame | None = None,
                      matched: dict[str, str] | None = None) -> list[Path]:
    """The matrix run only: task x stabilizer heatmap of the normalized-return gain over the baseline
    (injected variant, paired by seed), each cell annotated with the gain and the failure count; cells where
    the method does not act are grey, hatched, '='; the task's matched fix is outlined."""
    if per_run is None:
        if table is None or table.empty:
            raise Skip("the matrix was not run: no table given")
        per_run = scoring.outcomes(table)
    if matched is None:
        matched = matched_fixes(table)
    return draw_method_matrix(matrix_cells(per_run, matched), out)


def draw_method_matrix(cells: pd.DataFrame, out: Path) -> list[Path]:
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
    return _save(fig, out, "13_method_matrix")


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
    values["table:matrix_classes"] = _markdown(classes)
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
    (out / "tables" / "matrix.md").write_text(_markdown(shown))
    classes.to_csv(out / "tables" / "matrix_classes.csv", index=False)
    (out / "tables" / "matrix_classes.md").write_text(_markdown(classes))


FIGURES: list[tuple[str, Callable[[pd.DataFrame, Path], list[Path]]]] = [
    ("failure-mode map", fig_failure_map),
    ("KL estimators vs exact KL", fig_kl_estimators),
    ("per-layer gradient heatmap", fig_grad_heatmap),
    ("spectrum and effective rank", fig_spectrum),
    ("policy-gradient variance", fig_pg_variance),
    ("reasoning length and accuracy", fig_length),
    ("staleness grid", fig_staleness),
    ("policy churn", fig_churn),
    ("entropy", fig_entropy),
    ("tool-state ratio tails", fig_tool_ratios),
    ("stabilizer leaderboard", fig_leaderboard),
    ("detection latency", fig_latency),
    ("failure-mode x stabilizer matrix", fig_method_matrix),
    ("silent groups and the KL pull", fig_degenerate),
    ("training-inference KL against return", fig_inference_mismatch),
    ("route flips against return", fig_moe_routing),
    ("lucky shortcuts on impossible problems", fig_shortcuts),
    ("stated confidence against accuracy", fig_calibration),
    ("drift before a rule change", fig_plasticity),
    ("a reward model on stale features", fig_reward_model_drift),
]


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
        text = _markdown(frame)
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
        rendered["table:best_detectors"] = _markdown(best[["task", "detector", "diagnostic", "score", "ci_low",
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


def _markdown(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "(no rows)\n"

    def cell(v: object) -> str:
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


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
    (out / "figures").mkdir(parents=True, exist_ok=True)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    _setup()
    written: list[Path] = []
    # grid cells (rows with knobs) feed only the grid's own figure; everything else reads default runs
    main = table[table["cell"].fillna("") == ""] if "cell" in table else table
    if matrix == "auto":
        matrix = MATRIX if dirs and all(Path(d) in DEFAULT_RESULTS for d in dirs) else None
    matrix = Path(matrix) if matrix is not None else None
    matrix_table, matrix_reason = load_matrix(matrix)
    cells = classes = None
    if matrix_table is not None:
        matched = matched_fixes(matrix_table)
        cells = matrix_cells(scoring.outcomes(matrix_table), matched)
        classes = classify(cells, matched)
    for number, (title, draw) in enumerate(FIGURES, start=1):
        try:
            if draw is fig_method_matrix:
                if cells is None:
                    raise Skip(f"the matrix was not run: {matrix_reason}")
                paths = draw_method_matrix(cells, out)
            else:
                paths = draw(table if draw is fig_staleness else main, out)
        except Skip as why:
            log(f"[{number:>2}/{len(FIGURES)}] {title}: skipped: {why}")
            continue
        written += paths
        log(f"[{number:>2}/{len(FIGURES)}] {title}: {paths[0].with_suffix('.{pdf,png}')}")
    values = write_tables(main, out)
    if cells is not None and classes is not None:
        write_matrix_tables(cells, classes, out)
    values.update(matrix_values(cells, classes, matrix, matrix_reason))
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
