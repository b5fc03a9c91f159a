"""A task's paper paragraph takes its measured numbers from the runs (`suite.paragraphs`): counts of failed runs
and tail means on a constructed table, and every registered paragraph's placeholders name its own methods."""

import numpy as np
import pandas as pd
import pytest
from stabench.suite import paragraphs, registry
from stabench.suite.api import StabenchError

pytestmark = pytest.mark.smoke

TASK = registry.resolve_class("task", "calibration-collapse")
ITERATIONS, ONSET = 20, 5
TAIL = [0.1, 0.2, 0.3, 0.4, 0.5]  # per seed, over the ground truth's tail


def runs(failing: dict[str, set[int]]) -> pd.DataFrame:
    """Five seeds of each method, both variants; the injected runs of `failing[method]`'s seeds cross the ground
    truth's threshold in the tail, and the column `score` is 9 before the tail and TAIL[seed] in it."""
    gt = TASK.ground_truth
    bad = gt.threshold + 1 if gt.fails_when == "above" else gt.threshold - 1
    good = gt.threshold - 1 if gt.fails_when == "above" else gt.threshold + 1
    tail_from = ITERATIONS - int(np.ceil(gt.tail * ITERATIONS))
    rows = []
    for method, seeds in failing.items():
        for seed in range(len(TAIL)):
            for variant in ("injected", "control"):
                fails = variant == "injected" and seed in seeds
                for it in range(ITERATIONS):
                    rows.append({"task": TASK.id, "task_ref": TASK.id, "method": method, "seed": seed,
                                 "variant": variant, "role": "other", "acts": True, "status": "ok", "iteration": it,
                                 "onset_iteration": ONSET, "iterations": ITERATIONS, "return": 0.0,
                                 gt.metric: bad if fails else good,
                                 "score": TAIL[seed] if it >= tail_from else 9.0})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    return runs({"baseline": {0, 2, 4}, "fix": set()})


def test_failed_counts_the_runs_whose_ground_truth_failed(table):
    text = "the baseline fails {failed:baseline} seeds, the fix {failed:fix}, its control {failed:baseline:control}"
    assert paragraphs.fill(text, TASK, table) == "the baseline fails 3 of 5 seeds, the fix 0 of 5, its control 0 of 5"


def test_tail_numbers_read_only_the_ground_truths_tail(table):
    assert paragraphs.fill("{tail:score:baseline}", TASK, table) == "0.10-0.50"
    assert paragraphs.fill("{tail_mean:score:fix}", TASK, table) == "0.30"
    assert paragraphs.fill("{tail_percent:score:fix:control}", TASK, table) == "30%"
    one = table[table["seed"] == 1]
    assert paragraphs.fill("{tail:score:baseline}", TASK, one) == "0.20"


def test_an_absent_method_is_said_not_run_and_a_misspelt_placeholder_is_an_error(table):
    assert paragraphs.fill("{failed:other} and {tail:score:other}", TASK, table) == "(not run) and (not run)"
    assert paragraphs.fill("{tail:no_column:baseline}", TASK, table) == "(not run)"
    with pytest.raises(StabenchError, match="not one of"):
        paragraphs.fill("{fialed:baseline}", TASK, table)
    assert paragraphs.fill("a set {1, 2} stays", TASK, table) == "a set {1, 2} stays"


def test_columns_names_what_a_lean_table_must_keep():
    text = "{tail:heldout_confidence:baseline} {tail_percent:shortcut_rate:x:control} {failed:baseline}"
    assert paragraphs.columns([text]) == {"heldout_confidence", "shortcut_rate"}


def test_every_registered_paragraph_names_its_own_methods():
    for name in registry.names("task"):
        cls = registry.resolve_class("task", name)
        for match in paragraphs.PLACEHOLDER.finditer(cls.paper):
            kind, args = match.group(1), match.group(2).split(":")
            method = args[0] if kind == "failed" else args[1]
            assert kind in ("failed", *paragraphs.TAIL_KINDS), (name, match.group(0))
            assert method in cls.methods, (name, match.group(0))
