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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stabench.suite.api import REFERENCE_METHODS


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
            "checks": checks,
            "meets_bar": all(v is True for v in checks.values()),
            "meets_rate_checks": all(checks[name] is True for name in RATE_CHECKS),
        })
    return out


def format_markdown(rows: list[dict]) -> str:
    """The verdicts as one Markdown table (a check that failed is named in the last column)."""
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
