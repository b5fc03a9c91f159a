"""The score of a tidy table, the object `stabench score --json` prints: the stabilizer track, the aggregate
across tasks and the detector track. Its parts live by job: per-run outcomes (`suite.outcomes`), the statistics
(`suite.statistics`), the detector skill score (`suite.skill`) and the text forms (`suite.formatting`).
"""

from __future__ import annotations

import pandas as pd
from stabench.suite.outcomes import outcomes
from stabench.suite.skill import detector_track
from stabench.suite.statistics import across_tasks, stabilizer_track


def score(table: pd.DataFrame) -> dict:
    """The JSON object `stabench score --json` prints."""
    per_run = outcomes(table)
    return {
        "stabilizer_track": stabilizer_track(table, per_run),
        "aggregate": across_tasks(per_run),
        "detector_track": detector_track(table, per_run),
    }
