"""What a detector reads: the same columns whatever method runs, and no configuration column.

Checked on the committed results rather than on fresh trials: `results/matrix` holds every stabilizer of the matrix on
every default task (10 seeds, both variants) and `results/quick` the default sweep, so every column any of those
methods writes is in them, including the per-layer gradient norms of `multiskip-residual`'s deeper network and the
columns `no-update` leaves empty; the two experimental tasks are read from their calibration runs. `visible_frame`
selects the task's schema whatever the run holds, so a method that is not in those tables (a plugin) cannot add a
column either; and a schema column that held a setting would show as a value that does not vary across seeds.
"""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import detectors, registry, visibility

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]
TABLES = {"matrix": ROOT / "results/matrix", "quick": ROOT / "results/quick"}
EXPERIMENTAL = [ROOT / "results/calibration" / task / "seeds-0-9"
                for task, builtin in registry.discover("task").items() if builtin.fields.get("experimental")]


@pytest.fixture(scope="module")
def committed() -> dict[str, pd.DataFrame]:
    out = {}
    for name, folder in {**TABLES, **{p.parts[-2]: p for p in EXPERIMENTAL}}.items():
        if not (folder / "metrics.parquet").exists():
            pytest.skip(f"{folder} is not in this checkout")
        table = pd.read_parquet(folder / "metrics.parquet")
        out[name] = table[table["cell"].fillna("") == ""] if "cell" in table else table
    return out


def filled_by_method(table: pd.DataFrame) -> dict[tuple[str, str], set[str]]:
    """(task, method) -> the columns its runs fill."""
    counts = table.groupby(["task", "method"]).count()
    return {key: set(counts.columns[(row > 0).to_numpy()]) for key, row in counts.iterrows()}


def test_the_schema_is_what_the_baseline_fills_on_every_committed_table(committed):
    for name, table in committed.items():
        for task_id, columns in visibility.schema_of(table).items():
            assert visibility.VISIBLE[task_id] == columns, (name, task_id)
    defaults = {t for t in registry.names("task") if not registry.resolve_class("task", t).experimental}
    assert defaults <= set(committed["matrix"]["task"]) and set(registry.discover("task")) <= set(visibility.VISIBLE)


def test_every_method_sees_the_same_columns_and_what_a_method_adds_never_reaches_a_detector(committed):
    seen_added = set()
    for name, table in committed.items():
        filled = filled_by_method(table)
        heads = {key: run for key, run in table.groupby(["task", "method"]).head(3).groupby(["task", "method"])}
        for (task_id, method), columns in filled.items():
            task = registry.get_task(task_id)
            schema = visibility.VISIBLE[task_id]
            run = heads[(task_id, method)]
            assert list(detectors.visible_frame(run, task).columns) == list(schema), (name, task_id, method)
            assert list(detectors.visible_row(run.iloc[0].to_dict(), task)) == list(schema)
            added = {c for c in columns if not detectors.hidden(c, task, schema=False)} - set(schema)
            assert not set(detectors.visible_frame(run, task).columns) & added
            seen_added |= {(task_id, method, c) for c in added}
    # the cases the schema exists for: a deeper network's extra layers, and settings columns
    assert ("dead-layers", "multiskip-residual", "grad_norm/29") in seen_added
    assert not any(c.startswith("grad_norm/2") for c in visibility.VISIBLE["dead-layers"])


def test_no_visible_column_is_a_setting(committed):
    """Every visible column other than the clock varies across seeds at some iteration of some method and variant (it
    is measured); `iteration` and `step` are the same for every method and variant, except where `step` counts tokens
    (length-explosion), which is measured. The configuration columns fail this test: they are settings."""
    checked = 0
    for name in ("quick", "value-cold-start", "moe-routing"):
        table = committed[name]
        for task_id, rows in table.groupby("task"):
            schema = [c for c in visibility.VISIBLE[task_id] if c != "iteration"]
            config = sorted(c for c in visibility.configuration_columns(registry.get_task(task_id))
                            if c in rows and rows[c].notna().any())
            spread = rows.groupby(["method", "variant", "iteration"])[schema + config].nunique()
            seeds = rows.groupby(["method", "variant", "iteration"])["seed"].nunique()
            spread = spread[seeds > 1]
            varies = (spread > 1).mean()
            for c in schema:
                clock = rows.groupby("iteration")[c].nunique().max() <= 1
                assert varies[c] > 0.05 or clock, (task_id, c, varies[c])
                checked += 1
            for c in config:
                assert varies[c] == 0, (task_id, c)  # the rule would have caught every one of them
    assert checked > 200


def test_a_plugin_task_without_a_schema_hides_configuration_and_its_own_settings(tmp_path, monkeypatch):
    task = registry.get_task(f"{TOY}:ToyTask")
    row = {"iteration": 0, "step": 1, "grad_norm_total": 1.0, "learning_rate": 0.1, "acts": True, "return": 1.0}
    assert set(detectors.visible_row(row, task)) == {"iteration", "step", "grad_norm_total"}
    monkeypatch.setattr(type(task), "configuration", ("grad_norm_total",))
    assert set(detectors.visible_row(row, task)) == {"iteration", "step"}
    monkeypatch.setattr(type(task), "visible", ("iteration", "grad_norm_total", "learning_rate", "missing"))
    frame = detectors.visible_frame(pd.DataFrame([row]), task)  # a declared schema, less what is hidden
    assert list(frame.columns) == ["iteration", "missing"] and np.isnan(frame["missing"].iloc[0])
    monkeypatch.setattr(type(task), "configuration", ())
    assert list(detectors.visible_row(row, task)) == ["iteration", "grad_norm_total", "missing"]
