"""A finished run folder read back: the files a `stabench run` leaves, and its tidy table.

`stabench score` and `stabench.score` read folders through `load_tables`; the module imports neither Ray nor
the scorer, so reading a folder stays light.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from stabench.suite.api import StabenchError

if TYPE_CHECKING:
    import pandas as pd

METRICS = "metrics.parquet"  # the tidy table: one row per trial, variant and iteration
TRIALS = "trials.csv"  # one row per trial: its status, retries and time
MANIFEST = "manifest.json"  # the request, the suite and library versions


def load_table(folder: str | Path) -> pd.DataFrame:
    """The tidy table of one finished run folder, or one clear error."""
    import pandas as pd

    path = Path(folder) / METRICS
    if not path.is_file():
        raise StabenchError(f"no {METRICS} in {folder}: is it the --out folder of a finished `stabench run`?")
    try:
        return pd.read_parquet(path)
    except Exception as exc:
        raise StabenchError(f"cannot read {path}: {exc}") from exc


def load_tables(folders: Iterable[str | Path]) -> pd.DataFrame:
    """One table from several finished runs (for example one calibration run per task); rows of one run must not
    appear twice."""
    import pandas as pd

    tables = [load_table(f) for f in folders]
    if not tables:
        raise StabenchError("no run folder was given")
    if len(tables) == 1:
        return tables[0]
    table = pd.concat(tables, ignore_index=True)
    keys = [c for c in ("task", "cell", "method", "seed", "variant", "iteration") if c in table]
    if table.duplicated(keys).any():
        raise StabenchError("the runs overlap: the same task, method, seed and variant appears in two of them")
    return table
