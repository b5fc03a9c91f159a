"""What `stabench paper` reads of the results, and no more.

The default results are read whole: a task's figure may read any column of its own task's rows, and they are
small. The method matrix is large (every stabilizer on every default task, a million rows of some two hundred
columns, most of them another task's diagnostics and so empty), and the paper reads it only through scoring, the
detector figures and the studies: `read_lean` reads those columns (`lean_columns`) and the rows outside any grid
cell straight from the parquet file (pyarrow's projection and filter), so building the paper stays within a
laptop's memory as the matrix grows.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
from stabench.suite.api import StabenchError

# What scoring reads of every run (`suite.outcomes`, `suite.skill`, `suite.tradeoff`): who and where, the
# iteration, the onset and horizon, divergence and the true return. Plus, per task, the columns its `Task`
# names (`task_columns`) and every `alarm/` and `knob_` column.
RUN_COLUMNS = ("task", "task_ref", "task_version", "family", "tier", "cell", "method", "role", "acts", "seed",
               "variant", "iteration", "step", "phase", "status", "diverged_at", "onset_iteration", "iterations",
               "return")


def task_columns() -> set[str]:
    """The columns every registered task names for scoring: its ground truth's metric and its paired
    diagnostic."""
    from stabench.suite import registry

    out = set()
    for name in registry.names("task"):
        cls = registry.resolve_class("task", name)
        out |= {cls.ground_truth.metric, cls.detector.metric}
    return out


def lean_columns(names: Iterable[str], diagnostics: Iterable[str]) -> list[str]:
    """Of a file's columns (`names`, in their order), those scoring reads and the `diagnostics` the detector
    figures and studies replay."""
    wanted = set(RUN_COLUMNS) | task_columns() | set(diagnostics)
    return [n for n in names if n in wanted or n.startswith(("alarm/", "knob_"))]


def read_lean(path: Path, diagnostics: Iterable[str]) -> pd.DataFrame:
    """The rows of `path` (a metrics.parquet) outside any grid cell, only the columns `lean_columns` keeps. The
    rows are filtered only when some lie in a cell (a filter copies the table), and the table is converted to pandas
    column by column, each arrow buffer released once converted, so it is never held twice."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    table = pq.read_table(path, columns=lean_columns(names, diagnostics))
    if "cell" in names:
        outside = pc.or_kleene(pc.is_null(table["cell"]), pc.equal(table["cell"], ""))
        if not pc.all(outside).as_py():
            table = table.filter(outside)
    return released(table.to_pandas(split_blocks=True, self_destruct=True))


def load_results(dirs: list[Path]) -> pd.DataFrame:
    """The default results (or a user's run folders), every column: one table."""
    frames = []
    for directory in dirs:
        path = directory / "metrics.parquet"
        if not path.is_file():
            raise StabenchError(f"no metrics.parquet in {directory}")
        frames.append(pd.read_parquet(path))
    return released(pd.concat(frames, ignore_index=True))


def released(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame`, after `hand_back` (a read frees arrow buffers that pyarrow's allocator would keep)."""
    hand_back()
    return frame


def hand_back() -> None:
    """Return memory freed by the last step to the system: what pyarrow's allocator (mimalloc) keeps of the buffers
    a read freed (some 0.3 GiB after the matrix alone) and, with glibc, the heap pages Python and numpy freed
    (`malloc_trim`; other C libraries return them on their own or have no such call). Without it the paper's
    process grows by each step's temporaries, as fragments too small to reuse, by some 0.5 GiB over the figures."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> object:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
