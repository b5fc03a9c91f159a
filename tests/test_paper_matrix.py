"""The failure-mode x stabilizer matrix of `stabench paper` (`suite.matrix`): paired gains over the baseline,
the classes of methods (specific, broad, harms), and its figure, on small constructed outcome tables."""

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from stabench.suite import figures, matrix

pytestmark = pytest.mark.smoke

MATCHED = {"task-a": "fix-a", "task-b": "fix-b"}
SEEDS = range(5)
BASE = {"task-a": [0.10, 0.30, 0.20, 0.25, 0.15], "task-b": [0.40, 0.35, 0.50, 0.45, 0.30]}
# method -> task -> (acts, shift of the normalized return on each seed, fails on injected runs)
NOISE = [0.00, 0.02, -0.01, 0.01, -0.02]
METHODS = {
    "baseline": {"task-a": (True, 0.0, True), "task-b": (True, 0.0, True)},
    "twin": {"task-a": (True, 0.0, True), "task-b": (True, 0.0, True)},  # acts, but changes nothing
    "fix-a": {"task-a": (True, 0.5, False), "task-b": (False, 0.0, True)},  # no effect on task-b's trainer
    "fix-b": {"task-a": (True, 0.0, True), "task-b": (True, 0.4, False)},
    "wide": {"task-a": (True, 0.3, False), "task-b": (True, 0.3, False)},
    "bad": {"task-a": (True, -0.2, True), "task-b": (True, -0.1, True)},
    "no-update": {"task-a": (True, -0.3, True), "task-b": (True, -0.3, True)},
}


def per_run() -> pd.DataFrame:
    rows = []
    for method, tasks in METHODS.items():
        for task, (acts, shift, fails) in tasks.items():
            role = ("baseline" if method == "baseline" else "reference" if method == "no-update"
                    else "matched-fix" if MATCHED[task] == method else "other")
            for seed in SEEDS:
                noise = NOISE[seed] if shift else 0.0  # the same seed's baseline plus a shift, some noise
                for variant in ("injected", "control"):
                    value = BASE[task][seed] + (shift + noise if variant == "injected" else 0.6)
                    rows.append({"task": task, "method": method, "role": role, "acts": acts, "seed": seed,
                                 "variant": variant, "failed": fails and variant == "injected",
                                 "normalized_return": value})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def cells() -> pd.DataFrame:
    return matrix.matrix_cells(per_run(), MATCHED)


def cell(cells: pd.DataFrame, task: str, method: str) -> pd.Series:
    return cells[(cells["task"] == task) & (cells["method"] == method)].iloc[0]


def test_a_method_identical_to_the_baseline_gains_exactly_zero_with_a_zero_width_interval(cells):
    for method, task in (("twin", "task-a"), ("twin", "task-b"), ("baseline", "task-a"), ("fix-a", "task-b")):
        row = cell(cells, task, method)
        assert row["gain"] == 0.0 and row["ci_low"] == 0.0 and row["ci_high"] == 0.0, (method, task)
    assert not cell(cells, "task-b", "fix-a")["acts"]


def test_gains_are_paired_by_seed_with_an_interval_and_failure_rates(cells):
    row = cell(cells, "task-a", "fix-a")
    assert row["gain"] == pytest.approx(0.5)
    assert row["ci_low"] < 0.5 < row["ci_high"] and row["ci_low"] > 0.45  # the seed noise, not the baseline's spread
    assert row["matched"] and row["n_pairs"] == len(SEEDS)
    assert row["failure_rate"] == 0.0 and row["control_failure_rate"] == 0.0
    assert cell(cells, "task-a", "bad")["failure_rate"] == 1.0
    # baseline first, the matched fixes, the others, the references last
    order = list(cells["method"].drop_duplicates())
    assert order[:3] == ["baseline", "fix-a", "fix-b"] and order[-1] == "no-update"


def test_one_seed_gives_no_interval_and_nothing_significant():
    one = matrix.matrix_cells(per_run().query("seed == 0"), MATCHED)
    assert one["ci_low"].isna().all()
    classes = matrix.classify(one, MATCHED).set_index("method")["class"]
    assert classes["no-update"] == "reference"
    assert set(classes.drop("no-update")) == {"helps nowhere"}


def test_a_tiny_gain_does_not_count_however_significant():
    cells = pd.DataFrame([
        {"task": "task-a", "method": "nudge", "role": "other", "acts": True, "gain": 0.02, "ci_low": 0.01,
         "ci_high": 0.03},
        {"task": "task-b", "method": "nudge", "role": "other", "acts": True, "gain": 0.3, "ci_low": 0.2,
         "ci_high": 0.4},
        {"task": "task-a", "method": "dent", "role": "other", "acts": True, "gain": -0.05, "ci_low": -0.06,
         "ci_high": -0.04},
    ])
    classes = matrix.classify(cells, {"task-a": "fix-a", "task-b": "fix-b"}).set_index("method")
    assert classes.loc["nudge", "helps"] == "task-b" and classes.loc["nudge", "class"] == "narrow"
    assert classes.loc["dent", "harms"] == "" and classes.loc["dent", "class"] == "helps nowhere"

    # a small gain that saves at least half of the runs from failing does count
    saver = pd.DataFrame([
        {"task": "task-a", "method": "baseline", "role": "baseline", "acts": True, "gain": 0.0, "ci_low": 0.0,
         "ci_high": 0.0, "n_failed": 10, "n_runs": 10},
        {"task": "task-a", "method": "fix-a", "role": "matched-fix", "acts": True, "gain": 0.05, "ci_low": 0.04,
         "ci_high": 0.06, "n_failed": 0, "n_runs": 10},
    ])
    assert matrix.classify(saver, {"task-a": "fix-a"}).set_index("method").loc["fix-a", "class"] == "specific"


def test_methods_are_classified_specific_broad_harms_and_helps_nowhere(cells):
    classes = matrix.classify(cells, MATCHED).set_index("method")
    assert "baseline" not in classes.index
    assert classes.loc["fix-a", "class"] == "specific" and classes.loc["fix-a", "helps"] == "task-a"
    assert classes.loc["fix-b", "class"] == "specific" and classes.loc["fix-b", "matched fix of"] == "task-b"
    assert classes.loc["wide", "class"] == "broad" and classes.loc["wide", "helps"] == "task-a, task-b"
    assert classes.loc["bad", "class"] == "harms" and classes.loc["bad", "harms"] == "task-a, task-b"
    assert classes.loc["twin", "class"] == "helps nowhere" and classes.loc["twin", "harms"] == ""
    assert classes.loc["no-update", "role"] == "reference"
    assert classes.loc["fix-a", "acts on"] == 1


def test_a_fix_that_helps_another_task_than_its_own_is_not_specific():
    runs = per_run()
    moved = (runs["method"] == "fix-b") & (runs["task"] == "task-a") & (runs["variant"] == "injected")
    runs.loc[moved, "normalized_return"] += 0.3 + np.array(NOISE)[runs.loc[moved, "seed"]]
    classes = matrix.classify(matrix.matrix_cells(runs, MATCHED), MATCHED).set_index("method")
    assert classes.loc["fix-b", "class"] == "broad"
    runs.loc[(runs["method"] == "fix-b") & (runs["task"] == "task-b") & (runs["variant"] == "injected"),
             "normalized_return"] -= 0.4
    classes = matrix.classify(matrix.matrix_cells(runs, MATCHED), MATCHED).set_index("method")
    assert classes.loc["fix-b", "class"] == "narrow"


def test_the_sentences_and_tables_are_computed(cells, tmp_path):
    (tmp_path / "tables").mkdir()
    classes = matrix.classify(cells, MATCHED)
    values = matrix.matrix_values(cells, classes, tmp_path)
    assert "`fix-a` (task-a)" in values["value:matrix_specific"]
    assert "`wide` (task-a, task-b)" in values["value:matrix_broad"]
    assert "`bad` (task-a, task-b)" in values["value:matrix_harms"]
    assert values["value:matrix_wall_time"] == "The matrix: wall time not recorded in the run folder."
    matrix.write_matrix_tables(cells, classes, tmp_path)
    table = (tmp_path / "tables" / "matrix.md").read_text()
    assert "| task-a | fix-a | matched-fix | yes | +0.50 [" in table
    assert "| task-b | fix-a | other | no (= baseline) | +0.00 [+0.00, +0.00] | 5/5 | 0/5 |" in table
    assert len(pd.read_csv(tmp_path / "tables" / "matrix.csv")) == len(cells)


def test_without_a_matrix_the_text_says_it_was_not_run(tmp_path):
    table, reason = matrix.load_matrix(tmp_path / "missing")
    assert table is None and "stabench run --matrix" in reason
    values = matrix.matrix_values(None, None, None, reason)
    assert values["value:matrix_summary"].startswith("The failure-mode x stabilizer matrix was not run")
    assert set(values) >= {"value:matrix_specific", "value:matrix_broad", "value:matrix_wall_time",
                           "table:matrix_classes"}
    with pytest.raises(figures.Skip):
        matrix.fig_method_matrix(None, tmp_path, "suite_method-matrix")


def test_the_figure_is_drawn_from_a_table(tmp_path):
    (tmp_path / "figures").mkdir()
    figures.setup()
    paths = matrix.fig_method_matrix(None, tmp_path, "suite_method-matrix", per_run=per_run(), matched=MATCHED)
    png = tmp_path / "figures" / "suite_method-matrix.png"
    assert png in paths and (tmp_path / "figures" / "suite_method-matrix.pdf").read_bytes().startswith(b"%PDF")
    with Image.open(png) as image:
        image.verify()
        assert image.size[0] > 600 and image.size[1] > 300


def test_the_wall_time_of_an_extended_matrix_counts_every_session(tmp_path):
    import json

    pd.DataFrame({"status": ["ok", "ok", "identity"], "seconds": [30.0, 30.0, 0.0]}).to_csv(
        tmp_path / "trials.csv", index=False)
    sessions = [{"tasks": ["a"], "wall_seconds": 100.0}, {"tasks": ["b"], "wall_seconds": 20.0}]
    (tmp_path / "manifest.json").write_text(json.dumps({"wall_seconds": 120.0, "sessions": sessions}))
    text = matrix.matrix_wall_time(tmp_path)
    assert text.startswith("The matrix: 2 trials took 1.0 min of trial time in all; 2.0 min of wall time over 2 ")
    (tmp_path / "manifest.json").write_text(json.dumps({"wall_seconds": 120.0}))
    assert "sessions" not in matrix.matrix_wall_time(tmp_path)
