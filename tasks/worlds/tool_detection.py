"""The tools family's detection study: does a diagnostic read on the tool-state tokens warn where the same
diagnostic over every token does not?

Seed 004's detection claim, tested on every task that logs a tool-state split (rare-tool-states, tool-recovery):
each pair of `SPLIT_PAIRS` is a diagnostic split to the tokens written in tool states and the same diagnostic
over every token, read with the side fixed before any run was scored (the seed: tool states grow ratio tails, lose
effective sample size and stay uncertain). Each built-in change rule is replayed on both (`suite.detectors`'s
`replay_rules`) and scored by the detector track on the same runs. `stabench paper` writes the comparison
(`write_tables`: `tables/split_detection.md|csv`) and quotes its summary.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pandas as pd

SPLIT_PAIRS = (("ratio_p99_tool", "ratio_p99", True), ("ratio_ess_tool", "ratio_ess", False),
               ("entropy_tool", "entropy", True))
DIAGNOSTICS = tuple(m for split, aggregate, _ in SPLIT_PAIRS for m in (split, aggregate))


def split_detection(table: pd.DataFrame, per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per task logging a tool-state split, per pair of `SPLIT_PAIRS` and per built-in change rule (calibrated
    threshold, CUSUM, Page-Hinkley; warm-up half the onset): the rule's skill score with its 95% interval and
    median lead on the tool-state diagnostic and on its aggregate, scored on the same runs."""
    from stabench.suite import outcomes, registry, skill
    from stabench.suite.detectors import CalibratedThreshold, Cusum, PageHinkley, default_warmup, replay_rules

    kinds = {"calibrated-threshold": CalibratedThreshold, "cusum": Cusum, "page-hinkley": PageHinkley}
    per_run = outcomes.outcomes(table) if per_run is None else per_run
    out = []
    for task_id, rows in skill.task_slices(table):  # the rows the track would drop are not replayed
        pairs = [(s, a, up) for s, a, up in SPLIT_PAIRS if s in rows and a in rows and rows[s].notna().any()]
        if not pairs:
            continue
        task = registry.get_task(rows["task_ref"].iloc[0])
        budget = task.budget(rows["tier"].iloc[0])
        rules = {f"alarm/{kind}:{metric}": partial(cls, metric, default_warmup(budget), above=above, onset=budget.onset)
                 for kind, cls in kinds.items() for split, aggregate, above in pairs for metric in (split, aggregate)}
        columns = replay_rules(rows, task, rules, (m for s, a, _ in pairs for m in (s, a)))
        bare = rows.drop(columns=[c for c in rows.columns if c.startswith("alarm/")])
        scored = pd.DataFrame(skill.detector_track(bare.assign(**columns), per_run)).set_index("detector")
        for split, aggregate, above in pairs:
            for kind in kinds:
                mine, theirs = scored.loc[f"{kind}:{split}"], scored.loc[f"{kind}:{aggregate}"]
                out.append({"task": task_id, "tool-state diagnostic": split, "aggregate": aggregate,
                            "side": "above" if above else "below", "rule": kind,
                            "split score": mine["score"], "split ci_low": mine["ci_low"],
                            "split ci_high": mine["ci_high"], "split median lead": mine["median_lead"],
                            "aggregate score": theirs["score"], "aggregate ci_low": theirs["ci_low"],
                            "aggregate ci_high": theirs["ci_high"], "aggregate median lead": theirs["median_lead"],
                            "failing runs": int(mine["n_failures"]), "negative runs": int(mine["n_negatives"])})
    return pd.DataFrame(out)


def split_detection_summary(frame: pd.DataFrame) -> str:
    """One sentence on seed 004's claim from the comparison: where the tool-state reading is better (intervals apart),
    and whether it warned earlier there (median lead above 0 and above the aggregate's)."""
    if frame.empty:
        return "No task in these results logs a tool-state split, so the claim was not tested"
    shown = split_detection_table(frame)
    better = frame[shown["verdict"] == "split better"]
    worse = int((shown["verdict"] == "aggregate better").sum())
    earlier = better[(better["split median lead"] > 0)
                     & ~(better["split median lead"] <= better["aggregate median lead"])]
    where = ", ".join(f"{r['rule']} on {r['tool-state diagnostic']} ({r['task']})" for _, r in better.iterrows())
    text = (f"Of {len(frame)} comparisons the tool-state reading is better in {len(better)}"
            + (f" ({where})" if where else "") + f", the aggregate in {worse}, and the intervals overlap in the rest; ")
    if earlier.empty:
        return text + "in none is the better tool-state reading also earlier than the failure and the aggregate"
    return text + f"in {len(earlier)} it also warns earlier than both"


def split_detection_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The split-vs-aggregate comparison as a reader reads it, with the verdict per row (intervals apart or not)."""
    if frame.empty:
        return frame

    def cell(row: pd.Series, side: str) -> str:
        lead = row[f"{side} median lead"]
        lead_text = "-" if pd.isna(lead) else f"{lead:.0f}"
        return (f"{row[f'{side} score']:.1f} [{row[f'{side} ci_low']:.1f}, {row[f'{side} ci_high']:.1f}]; "
                f"lead {lead_text}")

    def verdict(row: pd.Series) -> str:
        if row["split ci_low"] > row["aggregate ci_high"]:
            return "split better"
        if row["aggregate ci_low"] > row["split ci_high"]:
            return "aggregate better"
        return "intervals overlap"

    return pd.DataFrame({
        "task": frame["task"], "rule": frame["rule"],
        "tool-state diagnostic (side)": frame["tool-state diagnostic"] + " (" + frame["side"] + ")",
        "score, tool states": frame.apply(cell, axis=1, side="split"),
        "score, aggregate": frame.apply(cell, axis=1, side="aggregate"),
        "verdict": frame.apply(verdict, axis=1),
        "runs (failing / negative)": frame["failing runs"].astype(str) + " / " + frame["negative runs"].astype(str),
    })


def write_tables(scored: list[tuple[pd.DataFrame, pd.DataFrame]], out: Path) -> dict[str, str]:
    """The study on each (rows, their outcomes) of `scored` (the paper's detector rows, then the tasks scored
    apart), one table: `out/tables/split_detection.csv` (every number) and `.md` (as read); returns the values the
    paper's text quotes (`table:split_detection`, `value:split_detection_summary`)."""
    from stabench.suite.figures import markdown_table

    frame = pd.concat([split_detection(rows, per_run) if len(rows) else pd.DataFrame() for rows, per_run in scored],
                      ignore_index=True)
    frame.to_csv(out / "tables" / "split_detection.csv", index=False)
    text = markdown_table(split_detection_table(frame))
    (out / "tables" / "split_detection.md").write_text(text)
    return {"table:split_detection": text, "value:split_detection_summary": split_detection_summary(frame)}
