"""The fidelity table: the field's published effects, written down in paper/predictions.json before the runs
that test them, each decided on the method matrix by the rule the file states, so that a result that disagrees with
the literature is reported, not tuned away.

Per prediction: the per-seed difference, method minus baseline, of the metric's post-onset mean over the injected
runs (seeds 0-9), and a 95% percentile bootstrap interval of their mean over seeds (`statistics.bootstrap_mean_ci`).
The metric is either a per-run score (`normalized_return`, `post_onset_return`: `outcomes.outcomes`, where the
iterations a diverged run never reached count at the floor) or a column of the table, averaged over the
iterations from onset on that logged it.

Verdicts: `match` (the interval lies wholly on the predicted side); for a directional prediction the mismatches
`opposite` (wholly on the other side) and `no effect` (it contains 0). A `none` prediction matches when the
interval contains 0 and lies within `NONE_TOLERANCE_RETURN` of it on normalized return, or within
`NONE_TOLERANCE_SHARE` of the baseline's mean on another metric; its mismatches are `effect` (the interval
excludes 0) and `wider than tolerance` (it contains 0 but reaches past the tolerance). `not testable`: the
prediction says no task has the regime, and the table holds no runs of its test; `not run`: the test is possible
but the table lacks its task, method or metric (a method or task built after the matrix was run).

An experimental task is not in the method matrix; its calibration run (seeds 0-9 of the quick tier, with the
baseline and its matched fix) tests a prediction on it by the same rule, and the verdict's note says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
from stabench.suite import outcomes, statistics
from stabench.suite.figures import markdown_table
from stabench.suite.paper_inputs import RUN_COLUMNS

PREDICTIONS = "predictions.json"
SEEDS = tuple(range(10))
NONE_TOLERANCE_RETURN = 0.05  # a `none` prediction on normalized return: the interval within +-0.05 of 0
NONE_TOLERANCE_SHARE = 0.10  # on another metric: within +-10% of the baseline's mean
RUN_SCORES = ("normalized_return", "post_onset_return")  # metrics scored per run, not read from a column
MISMATCHES = ("opposite", "no effect", "effect", "wider than tolerance")


@dataclass(frozen=True)
class Prediction:
    """One committed prediction: the claim, where it was reported, and its test on the suite."""

    id: str
    claim: str
    source: str
    regime: str
    task: str
    method: str
    metric: str
    direction: str  # "higher", "lower" or "none"
    testable: bool = True
    why_not: str = ""

    @classmethod
    def from_dict(cls, entry: dict) -> Prediction:
        test = entry["test"]
        if test["direction"] not in ("higher", "lower", "none"):
            raise ValueError(f"{entry['id']}: direction {test['direction']!r} is not higher, lower or none")
        return cls(id=entry["id"], claim=entry["claim"], source=entry["source"], regime=entry.get("regime", ""),
                   task=test["task"], method=test["method"], metric=test["metric"], direction=test["direction"],
                   testable=bool(entry.get("testable", True)), why_not=entry.get("why_not", ""))


@dataclass(frozen=True)
class Verdict:
    """A prediction decided: the paired difference, its interval, the verdict and why."""

    prediction: Prediction
    verdict: str
    n_seeds: int = 0
    difference: float = math.nan
    ci_low: float = math.nan
    ci_high: float = math.nan
    note: str = ""

    @property
    def mismatch(self) -> bool:
        return self.verdict in MISMATCHES


def read_predictions(path: Path) -> tuple[list[Prediction], str]:
    """The predictions of a predictions.json and its stated rule."""
    data = json.loads(Path(path).read_text())
    return [Prediction.from_dict(p) for p in data["predictions"]], data.get("rule", "")


def run_values(table: pd.DataFrame, task: str, methods: tuple[str, ...], metric: str,
               seeds: tuple[int, ...] = SEEDS) -> pd.DataFrame:
    """Per seed (rows) and method (columns): the metric's post-onset mean over the task's injected runs."""
    rows = table[(table["task"] == task) & table["method"].isin(methods) & (table["variant"] == "injected")
                 & table["seed"].isin(seeds)]
    if rows.empty:
        return pd.DataFrame(columns=list(methods), dtype=float)
    if metric in RUN_SCORES:
        per_run = outcomes.outcomes(rows)
        values = per_run.groupby(["seed", "method"])[metric].mean()
    else:
        post = rows[rows["iteration"] >= rows["onset_iteration"]]
        values = post.groupby(["seed", "method"])[metric].mean()  # NaN (an iteration that logged none) skipped
    return values.unstack("method").reindex(columns=list(methods)).astype(float)


def decide_interval(direction: str, low: float, high: float, tolerance: float) -> str:
    """The verdict of an interval of the paired difference against the predicted direction."""
    if direction == "none":
        if low > 0 or high < 0:
            return "effect"
        return "match" if -tolerance <= low and high <= tolerance else "wider than tolerance"
    sign = 1.0 if direction == "higher" else -1.0
    low, high = sorted((sign * low, sign * high))
    if low > 0:
        return "match"
    return "opposite" if high < 0 else "no effect"


def decide(prediction: Prediction, table: pd.DataFrame, seeds: tuple[int, ...] = SEEDS,
           known: set[str] | None = None) -> Verdict:
    """Decide one prediction on `table` (the method matrix's rows) by the rule. `known`: the names the suite
    registers (tasks and methods), to say whether something absent is unbuilt or only unrun."""
    p = prediction
    task_rows = table[table["task"] == p.task]
    missing = [f"task {p.task}"] if task_rows.empty else [
        f"method {m}" for m in (p.method, "baseline") if not (task_rows["method"] == m).any()]
    if not p.testable and missing:
        return Verdict(p, "not testable", note=p.why_not)
    if missing:
        unbuilt = [m for m in missing if known is not None and m.split(" ", 1)[-1] not in known]
        why = (f"the suite has no {', '.join(unbuilt)} yet" if unbuilt
               else f"the table holds no runs of {' or '.join(missing)}" + ("" if task_rows.empty else f" on {p.task}"))
        return Verdict(p, "not run", note=why)
    if p.metric not in RUN_SCORES and (p.metric not in table or task_rows[p.metric].isna().all()):
        return Verdict(p, "not run", note=f"{p.task}'s runs log no {p.metric}")
    values = run_values(table, p.task, (p.method, "baseline"), p.metric, seeds)
    paired = (values[p.method] - values["baseline"]).dropna().to_numpy(dtype=float)
    if len(paired) < 2:
        return Verdict(p, "not run", n_seeds=len(paired),
                       note=f"{len(paired)} paired seed(s): an interval needs two")
    low, high = statistics.bootstrap_mean_ci(paired)
    base = float(values["baseline"].mean())
    tolerance = NONE_TOLERANCE_RETURN if p.metric == "normalized_return" else NONE_TOLERANCE_SHARE * abs(base)
    notes = []
    if not p.testable:
        notes.append(f"written as not testable ({p.why_not}); decided on runs made since")
    if "acts" in task_rows and not task_rows.loc[task_rows["method"] == p.method, "acts"].all():
        notes.append(f"{p.method} does not change {p.task}'s trainer: its runs are the baseline's")
    verdict = decide_interval(p.direction, low, high, tolerance)
    if p.direction == "none":
        inside = -tolerance <= low and high <= tolerance
        notes.append(f"tolerance +-{tolerance:.3g}" + (", which the interval lies within" if inside and
                                                       verdict == "effect" else ""))
    return Verdict(p, verdict, n_seeds=len(paired),
                   difference=float(paired.mean()), ci_low=low, ci_high=high, note="; ".join(notes))


def fidelity(predictions: list[Prediction], table: pd.DataFrame | None, seeds: tuple[int, ...] = SEEDS,
             known: set[str] | None = None, absent: str = "") -> list[Verdict]:
    """Every prediction decided; with no table, every testable one `not run` for the reason `absent`."""
    if table is None:
        return [Verdict(p, "not testable", note=p.why_not) if not p.testable else Verdict(p, "not run", note=absent)
                for p in predictions]
    needed = {p.task for p in predictions}
    table = table[table["task"].isin(needed)]
    return [decide(p, table, seeds, known) for p in predictions]


def _verdict_text(v: Verdict) -> str:
    return f"mismatch: {v.verdict}" if v.mismatch else v.verdict


def fidelity_frame(verdicts: list[Verdict]) -> pd.DataFrame:
    """One row per prediction, the CSV's columns."""
    return pd.DataFrame([{
        "id": v.prediction.id, "claim": v.prediction.claim, "source": v.prediction.source,
        "task": v.prediction.task, "method": v.prediction.method, "metric": v.prediction.metric,
        "direction": v.prediction.direction, "n_seeds": v.n_seeds, "difference": v.difference,
        "ci_low": v.ci_low, "ci_high": v.ci_high, "verdict": v.verdict, "note": v.note,
    } for v in verdicts])


def fidelity_markdown(verdicts: list[Verdict]) -> str:
    """The table the paper shows: the difference with its interval in one column, mismatches named so."""
    def interval(v: Verdict) -> str:
        return "-" if math.isnan(v.difference) else f"{v.difference:+.3g} [{v.ci_low:+.3g}, {v.ci_high:+.3g}]"

    frame = fidelity_frame(verdicts).replace(r"\|", r"\|", regex=True)  # a "||" in a source is no cell border
    shown = pd.DataFrame({
        "id": frame["id"], "claim": frame["claim"], "source": frame["source"], "task": frame["task"],
        "method": frame["method"], "metric": frame["metric"], "direction": frame["direction"],
        "n seeds": [str(v.n_seeds) if v.n_seeds else "-" for v in verdicts],
        "difference [95% CI]": [interval(v) for v in verdicts],
        "verdict": [_verdict_text(v) for v in verdicts], "note": frame["note"].replace("", "-"),
    }) if verdicts else pd.DataFrame()
    return markdown_table(shown)


def predictions_path(out: Path) -> Path | None:
    """OUT's predictions.json if it has one, else the source tree's paper/ (where they were committed)."""
    candidates = [out / PREDICTIONS, Path(__file__).resolve().parent.parent / "paper" / PREDICTIONS]
    return next((c for c in candidates if c.is_file()), None)


def _read_rows(rows: pd.DataFrame, read: dict[str, set[str]]) -> pd.Series:
    """Which of `rows` are runs of a task in `read` by one of its methods there."""
    mask = pd.Series(False, index=rows.index)
    for task, methods in read.items():
        mask |= (rows["task"] == task) & rows["method"].isin(methods)
    return mask


def write_fidelity(table: pd.DataFrame | None, out: Path, absent: str = "",
                   calibration: pd.DataFrame | None = None) -> dict[str, str]:
    """tables/fidelity.csv|md from the method matrix's rows (`table`, None when there is no matrix: `absent` says
    why), and the `table:fidelity` value the paper's text quotes. `calibration`: rows of tasks the matrix lacks (the
    experimental tasks' calibration runs), which decide the predictions on those tasks."""
    from stabench.suite import registry

    path = predictions_path(out)
    if path is None:
        text = "No predictions.json was found beside the paper.\n"
        (out / "tables" / "fidelity.md").write_text(text)
        return {"table:fidelity": text}
    predictions, _ = read_predictions(path)
    known = set(registry.names("task")) | set(registry.names("stabilizer"))
    extra: set[str] = set()
    if table is not None and calibration is not None:
        calibration = calibration[~calibration["task"].isin(set(table["task"].unique()))]
        # only the rows a prediction reads (its task's baseline and method runs), before anything is joined
        tasks = {p.task for p in predictions}
        read = {task: {"baseline", *(p.method for p in predictions if p.task == task)} for task in tasks}
        # only the columns deciding reads (what scoring reads of the predicted tasks, and the predicted metrics), in
        # one copy: the calibration runs log every column, which would otherwise widen the matrix rows they join
        wanted = set(RUN_COLUMNS) | {p.metric for p in predictions}
        for task in tasks & set(registry.names("task")):
            cls = registry.resolve_class("task", task)
            wanted |= {cls.ground_truth.metric, cls.detector.metric}
        mine = _read_rows(table, read)
        table = pd.DataFrame({c: table[c][mine] for c in table.columns if c in wanted or c.startswith("knob_")})
        calibration = calibration[_read_rows(calibration, read)]
        extra = set(calibration["task"])
        calibration = calibration[[c for c in calibration.columns if c in wanted or c.startswith("knob_")]]
        table = pd.concat([table, calibration], ignore_index=True)
    verdicts = [v if v.prediction.task not in extra or v.verdict in ("not run", "not testable") else
                replace(v, note="; ".join(filter(None, [f"decided on {v.prediction.task}'s calibration run (an "
                                                        "experimental task: not in the matrix)", v.note])))
                for v in fidelity(predictions, table, SEEDS, known, absent)]
    fidelity_frame(verdicts).to_csv(out / "tables" / "fidelity.csv", index=False)
    text = fidelity_markdown(verdicts)
    (out / "tables" / "fidelity.md").write_text(text)
    return {"table:fidelity": text}
