"""Per-iteration curves of a run folder, for TensorBoard and Weights & Biases.

TensorBoard: an exact export of the tidy table (`metrics.parquet`), one TensorBoard run per trial and variant
(`<task>[/<cell>]/<method>/seed-<s>/<variant>`), step = `iteration`, one scalar tag per numeric column (alarms as
0/1); a value the table leaves empty (NaN) is not written, so a run that diverged stops where its rows stop.
Rows reach the driver inside checkpoints, so Ray Tune's per-trial loggers never see them: the export is written
from the table once the run is collected, with TensorBoard's own event writer, one event per row holding all its
tags (`SummaryWriter.add_scalar` would make one event per value). tests/test_tensorboard.py reads it back with
TensorBoard's reader.

Weights & Biases: `wandb_callback` checks, before anything runs, that `wandb` is installed and configured and
returns Ray Tune's `WandbLoggerCallback`; it sees what the trials report to Tune (sampled every
`report_every` iterations), never the whole table.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stabench.suite.api import StabenchError

if TYPE_CHECKING:
    import pandas as pd

TENSORBOARD = "tensorboard"  # the export's folder inside a run folder
MARKER = ".stabench-tensorboard"  # marks a folder this module wrote, and may therefore replace
RUN_KEYS = ("task", "cell", "method", "seed", "variant")  # one TensorBoard run
# numeric columns that name or describe a run rather than follow it from iteration to iteration
NOT_CURVES = frozenset({"seed", "iteration", "onset_iteration", "iterations", "diverged_at", "acts"})


def curve_columns(table: pd.DataFrame) -> list[str]:
    """The columns written as scalar tags: every numeric or boolean column but a run's identity (`NOT_CURVES`)
    and its grid knobs (`knob_*`, constant in a run)."""
    import pandas as pd

    return [c for c in table.columns
            if c not in NOT_CURVES and not c.startswith("knob_")
            and (pd.api.types.is_numeric_dtype(table[c]) or pd.api.types.is_bool_dtype(table[c]))]


def _part(value: Any) -> str:
    """One path component: a name that cannot climb out of the folder or split into two."""
    text = re.sub(r"[^\w.=,+-]", "_", str(value))
    return "_" if text in ("", ".", "..") else text


def run_name(task: str, cell: str, method: str, seed: int, variant: str) -> str:
    """The TensorBoard run of one trial's variant: `<task>[/<cell>]/<method>/seed-<s>/<variant>`."""
    parts = [task, *([cell] if cell else []), method, f"seed-{seed}", variant]
    return "/".join(_part(p) for p in parts)


def _prepare_folder(out: Path) -> Path:
    """A fresh folder beside `out` to write into; refuses an `out` that holds anything but an earlier export."""
    if out.exists() and not out.is_dir():
        raise StabenchError(f"{out} is a file, not a folder for TensorBoard runs")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise StabenchError(f"{out} holds files this export did not write; choose another folder")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def export(table: pd.DataFrame, out: str | Path) -> int:
    """Write the tidy table's curves as TensorBoard event files under `out`; returns the number of runs.

    `out` is replaced whole (an earlier export's runs would otherwise show twice); it is written beside and
    renamed into place, so a failed export leaves the earlier one."""
    import numpy as np
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    out = Path(out)
    if table.empty:
        raise StabenchError("the table holds no rows: nothing to export")
    missing = [k for k in RUN_KEYS if k not in table and k != "cell"] + (["iteration"] * ("iteration" not in table))
    if missing:
        raise StabenchError(f"the table lacks the column(s) {', '.join(missing)}: is it a stabench metrics table?")
    tags = curve_columns(table)
    if not tags:
        raise StabenchError("the table holds no numeric column: no curve to export")
    tmp = _prepare_folder(out)
    try:
        keys = table[[k for k in RUN_KEYS if k in table]].assign(
            cell=table["cell"].fillna("") if "cell" in table else "", iteration=table["iteration"])
        keys = keys[[*RUN_KEYS, "iteration"]].sort_values([*RUN_KEYS, "iteration"], kind="stable")
        order = keys.index.to_numpy()
        keys = keys.reset_index(drop=True)
        twice = keys.duplicated()
        if twice.any():
            task, cell, method, seed, variant, iteration = keys[twice].iloc[0]
            raise StabenchError(f"the table holds iteration {iteration} of "
                                f"{run_name(task, cell, method, int(seed), variant)} twice")
        values = table[tags].to_numpy(dtype=np.float64)[order]
        present = ~np.isnan(values)
        steps = keys["iteration"].to_numpy(dtype=np.int64)
        runs = keys[list(RUN_KEYS)]
        starts = np.flatnonzero((runs != runs.shift()).any(axis=1).to_numpy())
        bounds = [*starts.tolist(), len(keys)]
        now = time.time()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            task, cell, method, seed, variant = runs.iloc[lo]
            folder = tmp / run_name(task, cell, method, int(seed), variant)
            if folder.exists():
                raise StabenchError(f"two runs of the table share the TensorBoard run {folder.relative_to(tmp)}")
            folder.mkdir(parents=True)
            writer = EventFileWriter(str(folder))
            for row in range(lo, hi):  # one event per row, holding every tag the row has a value for
                summary = Summary(value=[Summary.Value(tag=tags[j], simple_value=values[row, j])
                                         for j in np.flatnonzero(present[row]).tolist()])
                writer.add_event(Event(wall_time=now, step=int(steps[row]), summary=summary))
            writer.close()
        (tmp / MARKER).write_text("TensorBoard runs exported from metrics.parquet by `stabench tensorboard`; "
                                  "a new export replaces this folder whole.\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return len(starts)


def export_folder(folder: str | Path, out: str | Path | None = None) -> tuple[Path, int]:
    """Export a finished run folder's table (to `folder/tensorboard` unless `out`); returns the path and runs."""
    from stabench.suite.results import load_table

    table = load_table(folder)
    target = Path(out) if out is not None else Path(folder) / TENSORBOARD
    return target, export(table, target)


WANDB_FORBIDDEN = "/\\#?%:"  # characters W&B refuses in a project name


def wandb_callback(project: str) -> Any:
    """Ray Tune's `WandbLoggerCallback` for `project`, after checking that `wandb` is installed and configured
    (an API key or `wandb login`, or WANDB_MODE offline/disabled); raises StabenchError otherwise. `wandb` is
    imported only here, and only when it is installed."""
    if not project or any(c in project for c in WANDB_FORBIDDEN):
        raise StabenchError(f"--wandb needs a W&B project name without any of {WANDB_FORBIDDEN!r}, got {project!r}")
    if importlib.util.find_spec("wandb") is None:
        raise StabenchError("--wandb needs the `wandb` package: pip install wandb, then wandb login")
    from ray.air.integrations.wandb import WandbLoggerCallback

    callback = WandbLoggerCallback(project=project)
    try:
        callback.setup()  # reads the API key as Tune will, so a missing one fails now, before anything runs
    except (ValueError, RuntimeError, OSError) as exc:
        raise StabenchError(f"--wandb: {str(exc).splitlines()[0]}") from exc
    return callback
