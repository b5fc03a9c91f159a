"""stabench: controlled experiments for reinforcement-learning training stability.

The public API: the contract (`Task`, `Stabilizer`, `Detector` and the specs they are built from, `Figure`),
the registries (`discover`, `get_task`, `make_stabilizer`, `names`, `register_task`, ...), and `run` and
`score` to sweep and score from Python as the `stabench` command does. Importing the package registers every gymnasium
environment the tasks declare under the `stabench/` namespace (read from their source; a task module is imported
only when `gym.make` builds its environment).

The code lives in three sub-packages: `stabench.suite` (the harness), `stabench.baselines` (trainers and
stabilizers) and `stabench.tasks` (one module per failure mode); dependencies point one way, tasks ->
baselines -> suite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import stabench.tasks  # noqa: F401  (registers the gymnasium environments)
from stabench.suite import __version__
from stabench.suite.api import (
    BATCH_SCHEMA,
    BEHAVIOUR_POLICY,
    LOSS_SCHEMA,
    POLICY_REUSE,
    REFERENCE_METHODS,
    Budget,
    Detector,
    DetectorSpec,
    Diverged,
    Figure,
    GroundTruth,
    StabenchError,
    Stabilizer,
    Task,
    ThresholdDetector,
    TrainState,
)
from stabench.suite.registry import (
    discover,
    get_task,
    make_detector,
    make_stabilizer,
    names,
    register_task,
    resolve_class,
)
from stabench.suite.sweep import run_sweep as run


def score(*folders: str | Path) -> dict[str, Any]:
    """The stabilizer and detector tracks of one or more finished runs (what `stabench score --json` prints)."""
    from stabench.suite.results import load_tables
    from stabench.suite.scoring import score as score_table

    return score_table(load_tables(folders))


__all__ = [
    "BATCH_SCHEMA", "BEHAVIOUR_POLICY", "LOSS_SCHEMA", "POLICY_REUSE", "REFERENCE_METHODS", "Budget", "Detector",
    "DetectorSpec", "Diverged", "Figure", "GroundTruth", "StabenchError", "Stabilizer", "Task", "ThresholdDetector",
    "TrainState", "__version__", "discover", "get_task", "make_detector", "make_stabilizer", "names",
    "register_task", "resolve_class", "run", "score",
]
