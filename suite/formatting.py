"""The score (`suite.scoring.score`) as text: Markdown tables (`results/calibration.md`, the paper) and the
plain tables `stabench score` prints."""

from __future__ import annotations

import math

import pandas as pd


def format_markdown(result: dict) -> str:
    """The score tables as Markdown (for `results/calibration.md` and the paper)."""

    def table(rows: list[dict], columns: list[str]) -> str:
        def cell(v: object) -> str:
            return f"{v:.3g}" if isinstance(v, float) else str(v)

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
        return "\n".join(lines)

    stab = [{**r, "normalized return [95% CI]": f"{r['normalized_return']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"}
            for r in result["stabilizer_track"]]
    parts = ["### Stabilizer track", "", table(stab, ["task", "method", "role", "acts", "failure_rate",
                                                     "control_failure_rate",
                                                     "normalized return [95% CI]", "control_normalized_return",
                                                     "drawdown", "n_seeds"])]
    agg = [{**r, "IQM [95% CI]": f"{r['iqm']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
            "P(improve) [95% CI]": (f"{r['probability_of_improvement']:.2f} [{r['poi_ci_low']:.2f}, "
                                    f"{r['poi_ci_high']:.2f}]") if "probability_of_improvement" in r else "-"}
           for r in result.get("aggregate", [])]
    if agg:
        for r in agg:
            unranked = "" if r.get("ranked", True) else " (unranked)"
            r["acts on"] = f"{len(r.get('acts_on', []))}/{r['n_tasks']}{unranked}"
        parts += ["", "### Across tasks", "", table(agg, ["method", "n_tasks", "acts on", "IQM [95% CI]",
                                                          "P(improve) [95% CI]"])]
    det = result.get("detector_track", [])
    if det:
        det = [{**r, "score [95% CI]": _score_ci(r)} for r in det]
        parts += ["", "### Detector track", "", table(det, ["task", "detector", "diagnostic", "score [95% CI]",
                                                            "detection_rate", "median_latency_frac",
                                                            "false_alarm_rate", "median_lead", "warned_before"])]
    return "\n".join(parts) + "\n"


def format_table(result: dict) -> str:
    """The human-readable form of `score`: three tables."""
    parts = []
    frame = pd.DataFrame(result["stabilizer_track"])
    if frame.empty:
        return "no runs to score"
    frame["normalized_return (95% CI)"] = [
        f"{r.normalized_return:6.3f} [{r.ci_low:6.3f}, {r.ci_high:6.3f}]" for r in frame.itertuples()
    ]
    cols = ["task", "method", "role", "acts", "failure_rate", "control_failure_rate", "normalized_return (95% CI)",
            "control_normalized_return", "drawdown", "n_seeds"]
    parts.append("stabilizer track\n" + frame[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    agg = pd.DataFrame(result.get("aggregate", []))
    if not agg.empty:
        agg["IQM (95% CI)"] = [f"{r.iqm:6.3f} [{r.ci_low:6.3f}, {r.ci_high:6.3f}]" for r in agg.itertuples()]
        if "probability_of_improvement" in agg:
            agg["P(improve over baseline) (95% CI)"] = [
                f"{r.probability_of_improvement:4.2f} [{r.poi_ci_low:4.2f}, {r.poi_ci_high:4.2f}]"
                if not pd.isna(r.probability_of_improvement) else "-"
                for r in agg.itertuples()
            ]
        if "acts_on" in agg:
            agg["acts on"] = [f"{len(r.acts_on)}/{r.n_tasks}" + ("" if r.ranked else " unranked")
                              for r in agg.itertuples()]
        keep = [c for c in ("method", "n_tasks", "acts on", "IQM (95% CI)", "P(improve over baseline) (95% CI)")
                if c in agg]
        parts.append("across tasks\n" + agg[keep].to_string(index=False))
    det = pd.DataFrame(result.get("detector_track", []))
    if not det.empty:
        det["score (95% CI)"] = [_score_ci(r) for r in det.to_dict("records")]
        cols = ["task", "detector", "diagnostic", "score (95% CI)", "detection_rate", "median_latency_frac",
                "false_alarm_rate", "median_lead", "warned_before"]
        parts.append("detector track\n" + det[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return "\n\n".join(parts)


def _score_ci(row: dict) -> str:
    """`41.2 [30.1, 52.0]` (the detector skill score and its interval), `-` when nothing failed."""
    value, low, high = (row.get(k, math.nan) for k in ("score", "ci_low", "ci_high"))
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:5.1f} [{low:5.1f}, {high:5.1f}]"
