"""The fidelity table (`suite.fidelity`): committed predictions decided by their own rule on small constructed
tables with planted effects, and the committed predictions.json read and written out."""

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from stabench.suite import fidelity, registry

pytestmark = pytest.mark.smoke

ONSET, ITERATIONS = 4, 10
SEEDS = range(10)
NOISE = np.linspace(-0.02, 0.02, len(SEEDS))


def table(shifts: dict[str, float], task: str = "task-a", metric: str = "entropy", noise: bool = True,
          base: float = 1.0) -> pd.DataFrame:
    """Injected and control runs of the baseline and each method: the metric is the baseline's per-seed level plus
    the method's shift (and some seed noise) from onset on; before onset every method logs a large value the
    post-onset mean must ignore."""
    rows = []
    for method, shift in {"baseline": 0.0, **shifts}.items():
        for seed in SEEDS:
            for variant in ("injected", "control"):
                level = base + 0.1 * seed + (shift + (NOISE[seed] if noise and shift else 0.0)
                                             if variant == "injected" else 0.0)
                for it in range(ITERATIONS):
                    rows.append({"task": task, "task_ref": task, "method": method, "seed": seed, "variant": variant,
                                 "role": "baseline" if method == "baseline" else "other", "acts": True,
                                 "status": "ok", "iteration": it, "onset_iteration": ONSET,
                                 "iterations": ITERATIONS, metric: level if it >= ONSET else 100.0 * (seed + 1)})
    return pd.DataFrame(rows)


def prediction(method: str = "fix", direction: str = "higher", task: str = "task-a", metric: str = "entropy",
               testable: bool = True) -> fidelity.Prediction:
    return fidelity.Prediction(id="P99", claim="a claim", source="a paper", regime="a regime", task=task,
                               method=method, metric=metric, direction=direction, testable=testable,
                               why_not="" if testable else "no task has the regime")


def test_a_planted_effect_in_the_predicted_direction_matches_and_is_measured_paired_by_seed():
    verdict = fidelity.decide(prediction(), table({"fix": 0.5}))
    assert verdict.verdict == "match" and not verdict.mismatch
    assert verdict.n_seeds == len(SEEDS)
    assert verdict.difference == pytest.approx(0.5)  # the pre-onset values (100 and up) left out
    # paired by seed: the interval is the noise's width, not the baseline's spread across seeds (0.9)
    assert 0.48 < verdict.ci_low < 0.5 < verdict.ci_high < 0.52
    down = fidelity.decide(prediction(direction="lower"), table({"fix": -0.5}))
    assert down.verdict == "match" and down.difference == pytest.approx(-0.5)


def test_the_opposite_effect_is_a_mismatch_labelled_opposite():
    for direction, shift in (("higher", -0.5), ("lower", 0.5)):
        verdict = fidelity.decide(prediction(direction=direction), table({"fix": shift}))
        assert verdict.verdict == "opposite" and verdict.mismatch, direction


def test_zero_effect_is_no_effect_for_a_direction_and_a_match_for_none():
    runs = table({"fix": 0.0})
    higher = fidelity.decide(prediction(direction="higher"), runs)
    assert higher.verdict == "no effect" and higher.mismatch
    assert higher.difference == 0.0 and higher.ci_low == 0.0 == higher.ci_high
    assert fidelity.decide(prediction(direction="none"), runs).verdict == "match"


def test_none_tolerates_only_a_tenth_of_the_baseline_on_another_metric_and_005_on_normalized_return():
    # the baseline's mean entropy is 1.45 here: +-0.145 is tolerated, a clear effect is not
    assert fidelity.decide(prediction(direction="none"), table({"fix": 0.5})).verdict == "effect"
    wide = table({"fix": 0.0})
    spread = dict(zip(SEEDS, np.linspace(-1, 1, len(SEEDS))))  # mean 0, seeds far apart
    mine = (wide["method"] == "fix") & (wide["iteration"] >= ONSET) & (wide["variant"] == "injected")
    wide.loc[mine, "entropy"] += wide.loc[mine, "seed"].map(spread)
    assert fidelity.decide(prediction(direction="none"), wide).verdict == "wider than tolerance"
    assert fidelity.decide_interval("none", -0.04, 0.049, fidelity.NONE_TOLERANCE_RETURN) == "match"
    assert fidelity.decide_interval("none", -0.04, 0.06, fidelity.NONE_TOLERANCE_RETURN) == "wider than tolerance"
    assert fidelity.decide_interval("none", 0.001, 0.02, fidelity.NONE_TOLERANCE_RETURN) == "effect"


def test_an_absent_method_or_task_is_not_run_and_says_whether_the_suite_has_it():
    runs = table({"fix": 0.5})
    unrun = fidelity.decide(prediction(method="other"), runs, known={"other", "task-a"})
    assert unrun.verdict == "not run" and "no runs of method other on task-a" in unrun.note
    unbuilt = fidelity.decide(prediction(method="other"), runs, known={"task-a"})
    assert unbuilt.verdict == "not run" and "no method other yet" in unbuilt.note
    no_task = fidelity.decide(prediction(task="task-b"), runs, known={"task-b", "fix"})
    assert no_task.verdict == "not run" and "no runs of task task-b" in no_task.note
    no_metric = fidelity.decide(prediction(metric="length_mean"), runs)
    assert no_metric.verdict == "not run" and "length_mean" in no_metric.note
    assert not unrun.mismatch and unrun.n_seeds == 0


def test_not_testable_stays_so_until_its_runs_exist_and_is_decided_when_they_do():
    runs = table({"fix": 0.5})
    absent = fidelity.decide(prediction(task="task-b", testable=False), runs)
    assert absent.verdict == "not testable" and absent.note == "no task has the regime"
    present = fidelity.decide(prediction(testable=False), runs)
    assert present.verdict == "match" and "written as not testable" in present.note


def test_normalized_return_is_the_per_run_score_through_the_tasks_floor_and_ceiling():
    task = registry.get_task("entropy-collapse")
    span = task.return_ceiling - task.return_floor
    runs = table({"fix": 0.25 * span}, task="entropy-collapse", metric="return", noise=False,
                 base=task.return_floor)
    verdict = fidelity.decide(prediction(task="entropy-collapse", metric="normalized_return"), runs)
    assert verdict.verdict == "match" and verdict.difference == pytest.approx(0.25)
    runs = table({"fix": 0.01 * span}, task="entropy-collapse", metric="return", noise=False,
                 base=task.return_floor)
    none = fidelity.decide(prediction(task="entropy-collapse", metric="normalized_return", direction="none"), runs)
    assert none.verdict == "effect" and "which the interval lies within" in none.note  # 0.01 < 0.05, but not 0


def test_only_the_given_seeds_count():
    runs = table({"fix": 0.5})
    verdict = fidelity.decide(prediction(), runs, seeds=(0, 1, 2))
    assert verdict.n_seeds == 3
    one = fidelity.decide(prediction(), runs, seeds=(0,))
    assert one.verdict == "not run" and one.n_seeds == 1


def test_the_committed_predictions_are_read_and_written_as_both_tables(tmp_path: Path):
    committed = Path(__file__).resolve().parent.parent / "paper" / "predictions.json"
    predictions, rule = fidelity.read_predictions(committed)
    raw = json.loads(committed.read_text())["predictions"]
    assert [p.id for p in predictions] == [p["id"] for p in raw] and "bootstrap" in rule
    (tmp_path / "tables").mkdir()
    values = fidelity.write_fidelity(None, tmp_path, absent="no matrix")
    frame = pd.read_csv(tmp_path / "tables" / "fidelity.csv", keep_default_na=False)
    assert list(frame["id"]) == [p.id for p in predictions]
    expected = ["not run" if p.testable else "not testable" for p in predictions]
    assert list(frame["verdict"]) == expected
    text = (tmp_path / "tables" / "fidelity.md").read_text()
    assert values["table:fidelity"] == text and text.count("\n") == len(predictions) + 2
    assert "difference [95% CI]" in text.splitlines()[0]


def test_mismatches_are_named_so_in_the_markdown():
    verdicts = [fidelity.decide(prediction(), table({"fix": -0.5})), fidelity.decide(prediction(), table({"fix": 0.5}))]
    rows = fidelity.fidelity_markdown(verdicts).splitlines()[2:]
    assert "mismatch: opposite" in rows[0] and "| match |" in rows[1]


def test_a_pipe_in_a_source_stays_inside_its_cell():
    piped = fidelity.Prediction(id="P98", claim="a claim", source="KL(pi||ref)", regime="", task="task-a",
                                method="fix", metric="entropy", direction="higher")
    row = fidelity.fidelity_markdown([fidelity.decide(piped, table({"fix": 0.5}))]).splitlines()[2]
    cells = re.split(r"(?<!\\)\|", row)[1:-1]
    assert len(cells) == 11 and cells[2].strip() == r"KL(pi\|\|ref)"


def test_a_prediction_on_an_experimental_task_is_decided_on_its_calibration_run(tmp_path: Path):
    (tmp_path / "tables").mkdir()
    (tmp_path / fidelity.PREDICTIONS).write_text(json.dumps({"rule": "r", "predictions": [
        {"id": "P1", "claim": "c", "source": "s", "regime": "g", "testable": False, "why_not": "no task yet",
         "test": {"task": "task-b", "method": "fix", "metric": "entropy", "direction": "higher"}},
        {"id": "P2", "claim": "c", "source": "s", "regime": "g", "testable": True,
         "test": {"task": "task-a", "method": "fix", "metric": "entropy", "direction": "higher"}}]}))
    matrix = table({"fix": 0.5}, task="task-a")
    calibration = pd.concat([table({"fix": -0.5}, task="task-b"), table({"fix": -0.5}, task="task-a")])
    fidelity.write_fidelity(matrix, tmp_path, calibration=calibration)
    frame = pd.read_csv(tmp_path / "tables" / "fidelity.csv", keep_default_na=False).set_index("id")
    assert frame.loc["P1", "verdict"] == "opposite"  # task-b is not in the matrix: its calibration run decides
    assert frame.loc["P1", "note"].startswith("decided on task-b's calibration run")
    assert frame.loc["P2", "verdict"] == "match" and "calibration" not in frame.loc["P2", "note"]  # the matrix wins
    fidelity.write_fidelity(matrix, tmp_path)
    frame = pd.read_csv(tmp_path / "tables" / "fidelity.csv", keep_default_na=False).set_index("id")
    assert frame.loc["P1", "verdict"] == "not testable"
