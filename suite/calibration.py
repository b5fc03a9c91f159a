"""Whether a task's calibration shows its failure: the bar a task must clear to join the default suite.

Read from the stabilizer track of a calibration run (default methods plus both reference stabilizers), per
task:
- references (`no-update`, `frozen-at-onset`): normalized return at most 0.1 and failure rate at least 80%
  on injected runs: a learner that does not learn fails;
- baseline: injected failure at least 80%, control failure at most 10%, control normalized return at least
  0.8: the injection breaks learning that the control really does;
- matched fix: failure at most 20% and at least 60 points below the baseline's, and the lower end of its
  normalized-return interval above the upper ends of the baseline's and of both references' intervals.
Each check is reported on its own, so a task that misses says where. The failure-rate checks (`RATE_CHECKS`)
are the ones a fresh-seed run must pass too: the return checks read a floor and a ceiling fixed on the
calibration seeds, and on other seeds the policy at onset, and so what freezing it earns, differs.

Every failure rate is printed with its exact (Clopper-Pearson) 95% binomial interval, and each rate check with
its margin in seeds (`spare`): how many more runs could turn the other way before the check misses. A margin of
0 is a verdict within one seed of the bar, which another machine or other seeds can flip (`thin`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scipy.stats import binomtest
from stabench.suite.api import REFERENCE_METHODS

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class Bar:
    reference_max_return: float = 0.1
    reference_min_failure: float = 0.8
    baseline_min_failure: float = 0.8
    control_max_failure: float = 0.1
    control_min_return: float = 0.8
    fix_max_failure: float = 0.2
    fix_min_gap: float = 0.6


BAR = Bar()
RATE_CHECKS = ("references fail", "baseline fails", "control healthy", "fix helps")


def _finite(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(float(value)) else math.nan


def binomial_interval(failed: int, runs: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a failure rate of `failed` in `runs`; NaNs without runs."""
    if runs <= 0:
        return math.nan, math.nan
    ci = binomtest(int(failed), int(runs)).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


def rate_text(failed: int, runs: int) -> str:
    """`8/10 [0.44, 0.97]`: the count and its 95% binomial interval."""
    low, high = binomial_interval(failed, runs)
    return f"{failed}/{runs} [{low:.2f}, {high:.2f}]" if runs else "-"


def _at_least(failed: int, runs: int, share: float) -> int:
    """Spare seeds of `failed / runs >= share`: how many failures could turn healthy before it misses."""
    return failed - math.ceil(share * runs - 1e-9)


def _at_most(failed: int, runs: int, share: float) -> int:
    """Spare seeds of `failed / runs <= share`."""
    return math.floor(share * runs + 1e-9) - failed


def margins(rows: dict[str, dict], bar: Bar = BAR) -> dict[str, int | None]:
    """Per rate check, its margin in seeds (negative: missed by that many; None: the run lacks the methods)."""
    base, fix = rows.get("baseline"), rows.get("matched-fix")
    refs = [rows[m] for m in REFERENCE_METHODS if m in rows]
    counted = all("runs" in r for r in [base, fix, *refs] if r is not None)
    if not counted:
        return dict.fromkeys(RATE_CHECKS)
    out: dict[str, int | None] = {
        "references fail": (min(_at_least(r["failed_runs"], r["runs"], bar.reference_min_failure) for r in refs)
                            if len(refs) == len(REFERENCE_METHODS) else None),
        "baseline fails": (_at_least(base["failed_runs"], base["runs"], bar.baseline_min_failure)
                           if base else None),
        "control healthy": (_at_most(base["control_failed_runs"], base["control_runs"], bar.control_max_failure)
                            if base else None),
        "fix helps": None,
    }
    if base and fix:
        gap = (base["failed_runs"] - fix["failed_runs"]) - math.ceil(bar.fix_min_gap * fix["runs"] - 1e-9)
        out["fix helps"] = min(_at_most(fix["failed_runs"], fix["runs"], bar.fix_max_failure), gap)
    return out


def _counts(base: dict | None, fix: dict | None, rows: dict[str, dict]) -> dict[str, tuple[int, int]]:
    """(failed, runs) of the baseline's injected and control runs, the fix's and each reference's, where counted."""
    counts: dict[str, tuple[int, int]] = {}
    if base is not None and "runs" in base:
        counts["baseline"] = (base["failed_runs"], base["runs"])
        counts["control"] = (base.get("control_failed_runs", 0), base.get("control_runs", 0))
    for name, row in (("fix", fix), *((m, rows.get(m)) for m in REFERENCE_METHODS)):
        if row is not None and "runs" in row:
            counts[name] = (row["failed_runs"], row["runs"])
    return counts


def verdicts(stabilizer_rows: list[dict], bar: Bar = BAR) -> list[dict]:
    """One verdict per task of a stabilizer track: each check's outcome (True, False, or None where the run
    lacks the methods it needs) and `meets_bar`, True only when every check passed."""
    by_task: dict[str, dict[str, dict]] = {}
    for row in stabilizer_rows:
        by_task.setdefault(row["task"], {})[row["role"] if row["role"] in ("baseline", "matched-fix")
                                           else row["method"]] = row
    out = []
    for task, rows in sorted(by_task.items()):
        base, fix = rows.get("baseline"), rows.get("matched-fix")
        refs = [rows[m] for m in REFERENCE_METHODS if m in rows]
        checks: dict[str, bool | None] = {}
        complete = len(refs) == len(REFERENCE_METHODS)
        checks["references fail"] = (all(r["failure_rate"] >= bar.reference_min_failure for r in refs)
                                     if complete else None)
        checks["references score low"] = (all(_finite(r["normalized_return"]) <= bar.reference_max_return
                                              for r in refs) if complete else None)
        if base is None:
            checks.update({"baseline fails": None, "control healthy": None, "control learns": None})
        else:
            checks["baseline fails"] = base["failure_rate"] >= bar.baseline_min_failure
            checks["control healthy"] = _finite(base["control_failure_rate"]) <= bar.control_max_failure
            checks["control learns"] = _finite(base.get("control_normalized_return")) >= bar.control_min_return
        if fix is None or base is None:
            checks["fix helps"] = None
            checks["fix interval clear"] = None
        else:
            checks["fix helps"] = (fix["failure_rate"] <= bar.fix_max_failure
                                   and fix["failure_rate"] <= base["failure_rate"] - bar.fix_min_gap + 1e-9)
            above = [base] + refs
            checks["fix interval clear"] = all(_finite(fix["ci_low"]) > _finite(r["ci_high"]) for r in above)
        out.append({
            "task": task,
            "fix": fix["method"] if fix else None,
            "baseline_failure": base["failure_rate"] if base else math.nan,
            "control_failure": base["control_failure_rate"] if base else math.nan,
            "control_return": base.get("control_normalized_return", math.nan) if base else math.nan,
            "fix_failure": fix["failure_rate"] if fix else math.nan,
            "fix_return": fix["normalized_return"] if fix else math.nan,
            "reference_failure": min((r["failure_rate"] for r in refs), default=math.nan),
            "reference_return": max((_finite(r["normalized_return"]) for r in refs), default=math.nan),
            "counts": _counts(base, fix, rows),
            "margins": (spare := margins(rows, bar)),
            "thin": sorted(name for name, m in spare.items() if m == 0),
            "checks": checks,
            "meets_bar": all(v is True for v in checks.values()),
            "meets_rate_checks": all(checks[name] is True for name in RATE_CHECKS),
        })
    return out


def format_markdown(rows: list[dict]) -> str:
    """The verdicts as Markdown: one table of rates and checks (a check that failed is named), then one of the
    failure counts with their 95% binomial intervals and each rate check's margin in seeds."""
    return _verdict_table(rows) + "\n" + _margin_table(rows)


def _margin_table(rows: list[dict]) -> str:
    names = ["baseline", "control", "fix", *REFERENCE_METHODS]
    lines = ["| task | " + " | ".join(f"{n} failed [95% CI]" for n in names) + " | spare seeds (" +
             ", ".join(RATE_CHECKS) + ") | within one seed of the bar |", "|" + "---|" * (len(names) + 3)]
    for r in rows:
        counts = r.get("counts", {})
        cells = [rate_text(*counts[n]) if n in counts else "-" for n in names]
        spare = ", ".join("-" if r["margins"].get(c) is None else str(r["margins"][c]) for c in RATE_CHECKS)
        lines.append(f"| {r['task']} | " + " | ".join(cells) + f" | {spare} | {', '.join(r['thin']) or 'no'} |")
    return "\n".join(lines) + "\n"


def _verdict_table(rows: list[dict]) -> str:
    lines = ["| task | baseline failed | control failed | control return | fix | fix failed | fix return | "
             "references failed (min) | references return (max) | bar | failure-rate checks |", "|" + "---|" * 11]
    for r in rows:
        missed = [name for name, ok in r["checks"].items() if ok is not True]
        verdict = "met" if r["meets_bar"] else "missed: " + ", ".join(
            f"{n}{' (not run)' if r['checks'][n] is None else ''}" for n in missed)
        lines.append(
            f"| {r['task']} | {r['baseline_failure']:.0%} | {r['control_failure']:.0%} | {r['control_return']:.2f} | "
            f"{r['fix'] or '-'} | {r['fix_failure']:.0%} | {r['fix_return']:.2f} | {r['reference_failure']:.0%} | "
            f"{r['reference_return']:.2f} | {verdict} | {'met' if r['meets_rate_checks'] else 'missed'} |"
        )
    return "\n".join(lines) + "\n"


# The verdicts of the committed calibration runs, one row per task and seed set, written by
# `stabench score DIR --calibration --write-margins FILE` (results/regenerate.sh) and read by `stabench list`,
# the leaderboard and the paper, so a thin or missed verdict is stated wherever the task is shown, from data.
MARGINS_FILE = Path("results") / "calibration" / "margins.csv"
CALIBRATION_SEEDS = "0-9"  # the seeds floors and ceilings are fixed on; other seed sets are fresh
MARGIN_COLUMNS = ("task", "seeds", "meets_bar", "meets_rate_checks", "missed", "thin",
                  *(f"spare: {c}" for c in RATE_CHECKS))


def seed_label(seeds: Iterable[int]) -> str:
    """`0-9` for a contiguous range, else the seeds joined by spaces."""
    values = sorted({int(s) for s in seeds})
    if not values:
        return ""
    if values == list(range(values[0], values[-1] + 1)) and len(values) > 1:
        return f"{values[0]}-{values[-1]}"
    return " ".join(str(v) for v in values)


def margin_records(verdict_rows: list[dict], seeds: dict[str, str]) -> list[dict]:
    """One record per task of `verdicts(...)`, on the seed set `seeds[task]` (a `seed_label`)."""
    records = []
    for r in verdict_rows:
        missed = [name for name, ok in r["checks"].items() if ok is not True]
        record = {"task": r["task"], "seeds": seeds.get(r["task"], ""), "meets_bar": bool(r["meets_bar"]),
                  "meets_rate_checks": bool(r["meets_rate_checks"]), "missed": "; ".join(missed),
                  "thin": "; ".join(r["thin"])}
        record.update({f"spare: {c}": ("" if r["margins"].get(c) is None else int(r["margins"][c]))
                       for c in RATE_CHECKS})
        records.append(record)
    return records


def write_margins(records: list[dict], path: Path) -> None:
    """Add `records` to the file at `path`, replacing the rows of the same task and seed set (atomically)."""
    import pandas as pd

    new = pd.DataFrame(records, columns=list(MARGIN_COLUMNS))
    if path.is_file():
        old = pd.read_csv(path, dtype=str, keep_default_na=False)
        keep = ~pd.Series(list(zip(old["task"], old["seeds"]))).isin(set(zip(new["task"], new["seeds"])))
        new = pd.concat([old[keep.to_numpy()], new.astype(str)], ignore_index=True)
    first = new["seeds"].astype(str).str.extract(r"^(\d+)")[0].astype(float)  # seed sets in numeric order
    new = new.astype(str).assign(_first=first).sort_values(["task", "_first", "seeds"]).drop(columns="_first")
    new = new.reset_index(drop=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    new.to_csv(tmp, index=False)
    tmp.replace(path)


def margin_notes(path: Path | None = None) -> dict[str, str]:
    """Per task, what its committed calibration says beyond 'met with a seed to spare': checks missed and checks
    within one seed of the bar, each with its seed set. Tasks with nothing to say are absent; so is everything
    when the file is absent (a plugin's folder, an installed copy without results)."""
    import csv

    path = path or Path(__file__).resolve().parent.parent / MARGINS_FILE  # the checkout's, as for paper/'s inputs
    if not path.is_file():
        return {}
    notes: dict[str, list[str]] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            said = []
            missed = [c for c in row["missed"].split("; ") if c and (row["seeds"] == CALIBRATION_SEEDS
                                                                      or c in RATE_CHECKS)]
            if missed:  # on fresh seeds only the failure-rate checks apply (the module docstring)
                said.append(f"missed {'; '.join(missed)}")
            if row["thin"]:
                said.append(f"within one seed of the bar: {row['thin']}")
            if said:
                notes.setdefault(row["task"], []).append(f"seeds {row['seeds']}: " + "; ".join(said))
    return {task: " | ".join(parts) for task, parts in notes.items()}


def measured_anchors(per_run: pd.DataFrame) -> list[dict]:
    """Per task of `per_run` (`suite.outcomes.outcomes` rows): its declared `return_floor` and `return_ceiling`
    beside what a run measures for them, the mean post-onset return of `frozen-at-onset`'s injected runs (the floor)
    and of the baseline's control runs (the ceiling where the task anchors on the control's reach), with their
    seeds. A task that anchors its ceiling elsewhere (an exact optimum) says so in its own docstring; this prints
    both, and a maintainer copies a measured value into the task only where the task defines it so."""
    from stabench.suite import registry

    out = []
    for task_id, runs in per_run.groupby("task", sort=True):
        cls = registry.resolve_class("task", str(task_id))
        floor = runs[(runs["method"] == "frozen-at-onset") & (runs["variant"] == "injected")]["post_onset_return"]
        ceiling = runs[(runs["method"] == "baseline") & (runs["variant"] == "control")]["post_onset_return"]
        out.append({"task": task_id, "return_floor": cls.return_floor,
                    "measured floor": float(floor.mean()) if len(floor) else math.nan, "floor seeds": len(floor),
                    "return_ceiling": cls.return_ceiling,
                    "measured ceiling": float(ceiling.mean()) if len(ceiling) else math.nan,
                    "ceiling seeds": len(ceiling)})
    return out


def format_anchors(rows: list[dict]) -> str:
    """`measured_anchors` as a Markdown table (four decimals, as the tasks declare them)."""
    columns = ["task", "return_floor", "measured floor", "floor seeds", "return_ceiling", "measured ceiling",
               "ceiling seeds"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c])
                                       for c in columns) + " |")
    return "\n".join(lines)
