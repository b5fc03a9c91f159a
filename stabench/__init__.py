"""stabench: controlled experiments for reinforcement-learning training stability.

The public API: the contract (`Task`, `Stabilizer`, `Detector` and the specs they are built from), the
registries (`get_task`, `make_stabilizer`, `names`, ...), and `run` and `score` to sweep and score from
Python as the `stabench` command does. Importing the package registers every task's gymnasium environment
under the `stabench/` namespace (lazily: a task module is imported when `gym.make` builds its environment).

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
    REFERENCE_METHODS,
    Budget,
    Detector,
    DetectorSpec,
    Diverged,
    GroundTruth,
    StabenchError,
    Stabilizer,
    Task,
    ThresholdDetector,
    TrainState,
)
from stabench.suite.registry import (
    BUILTIN_DETECTORS,
    BUILTIN_STABILIZERS,
    BUILTIN_TASKS,
    get_task,
    make_detector,
    make_stabilizer,
    names,
    resolve_class,
)


def run(tasks: list[str] | tuple[str, ...] | None = None, *, tier: str = "quick",
        methods: list[str] | tuple[str, ...] | None = None, seeds: int | None = None, seed_start: int = 0,
        out: str | Path | None = None, cpus: int | None = None, address: str | None = None,
        matrix: bool = False, resume: bool = False) -> Path:
    """Run a sweep as `stabench run` does and return its folder (the parquet table is `metrics.parquet` in it).

    `tasks` defaults to the default suite; `methods` to each task's own methods and the references;
    `matrix=True` runs every registered stabilizer on every task instead. Names may be registered names or
    plugin references (`path/to/file.py:ClassName`).
    """
    from stabench.suite.cli import build_parser, run_sweep

    argv = ["run", "--tier", tier, "--seed-start", str(seed_start)]
    if tasks:
        argv += ["--tasks", ",".join(tasks)]
    if methods:
        argv += ["--methods", ",".join(methods)]
    for flag, value in (("--seeds", seeds), ("--out", out), ("--cpus", cpus), ("--address", address)):
        if value is not None:
            argv += [flag, str(value)]
    if matrix:
        argv.append("--matrix")
    if resume:
        argv.append("--resume")
    return run_sweep(build_parser().parse_args(argv))


def score(*folders: str | Path) -> dict[str, Any]:
    """The stabilizer and detector tracks of one or more finished runs (what `stabench score --json` prints)."""
    from stabench.suite.cli import _load_tables
    from stabench.suite.scoring import score as score_table

    return score_table(_load_tables([str(f) for f in folders]))


__all__ = [
    "BATCH_SCHEMA", "BUILTIN_DETECTORS", "BUILTIN_STABILIZERS", "BUILTIN_TASKS", "REFERENCE_METHODS", "Budget",
    "Detector", "DetectorSpec", "Diverged", "GroundTruth", "StabenchError", "Stabilizer", "Task",
    "ThresholdDetector", "TrainState", "__version__", "get_task", "make_detector", "make_stabilizer", "names",
    "resolve_class", "run", "score",
]
