"""Detectors on constructed streams whose change point is known (the score's bars: tests/test_detector_score.py)."""

import math

import numpy as np
import pytest
from stabench.suite.detectors import (
    Always,
    CalibratedThreshold,
    Cusum,
    Never,
    PageHinkley,
    RandomAlarm,
    RandomAlarm1,
    RandomAlarm20,
)

pytestmark = pytest.mark.smoke


def stream(change_at: int = 40, n: int = 80, shift: float = 3.0, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    values = rng.normal(0.0, 1.0, n) + np.where(np.arange(n) >= change_at, shift, 0.0)
    return [{"x": float(v)} for v in values]


def first_alarm(detector, rows) -> int | None:
    for i, row in enumerate(rows):
        if detector.update(row):
            return i
    return None


@pytest.mark.parametrize(
    ("make", "shift"),
    [(lambda: Cusum("x", 20), 3.0), (lambda: PageHinkley("x", 20), 3.0), (lambda: CalibratedThreshold("x", 20), 6.0)],
)
def test_change_detectors_alarm_soon_after_a_known_shift_and_rarely_on_quiet_streams(make, shift):
    """Over 50 streams: a shift at 40 is caught within 12 rows at least 90% of the time; quiet streams
    (the warm-up's sigma is estimated from only 20 points) raise an alarm in at most 20% of cases."""
    hits = [first_alarm(make(), stream(shift=shift, seed=s)) for s in range(50)]
    quiet = [first_alarm(make(), stream(shift=0.0, seed=s)) for s in range(50)]
    assert sum(h is not None and 40 <= h <= 52 for h in hits) >= 45, hits
    assert sum(q is not None for q in quiet) <= 10, quiet


def test_direction_is_respected_and_missing_values_never_alarm():
    down = [{"x": -r["x"]} for r in stream()]
    assert first_alarm(Cusum("x", 20, above=True), down) is None
    assert first_alarm(Cusum("x", 20, above=False), down) is not None
    assert first_alarm(Cusum("x", 5), [{"x": math.nan}] * 50 + [{"y": 1.0}] * 5) is None


def test_reference_detectors():
    rows = stream()
    assert first_alarm(Never(), rows) is None
    assert first_alarm(Always(), rows) == 0
    rate = np.mean([d.update({}) for d in [RandomAlarm(0.1, seed=2)] for _ in range(5000)])
    assert 0.08 < rate < 0.12
    for cls, expected in ((RandomAlarm1, 0.01), (RandomAlarm, 0.05), (RandomAlarm20, 0.20)):
        detector = cls(seed=3)
        assert abs(np.mean([detector.update({}) for _ in range(20000)]) - expected) < 0.01, cls.name


def test_the_warm_up_is_capped_at_the_onset_and_never_reads_a_post_onset_row():
    rows = [{"x": v} for v in (1.0, 2.0, 3.0, 100.0, 100.0, 100.0)]
    capped = CalibratedThreshold("x", 5, onset=3)  # warm-up 5 asked, 3 pre-onset rows: those 3
    assert first_alarm(capped, rows) == 3 and capped.mu == 2.0 and capped._seen == [1.0, 2.0, 3.0]
    assert first_alarm(CalibratedThreshold("x", 5), rows) is None  # uncapped, the shift itself became "healthy"
    gap = Cusum("x", 3, onset=3)  # a missing pre-onset value is not replaced by a post-onset one
    first_alarm(gap, [{"x": math.nan}, {"x": 1.0}, {"x": 3.0}, {"x": 50.0}])
    assert gap._seen == [1.0, 3.0] and gap.mu == 2.0
    lone = PageHinkley("x", 3, onset=1)  # one pre-onset row: no healthy statistics, never an alarm
    assert first_alarm(lone, [{"x": 1.0}] + [{"x": 1e6}] * 30) is None and math.isnan(lone.sigma)


def test_every_built_in_reads_healthy_statistics_from_pre_onset_rows_only_on_every_task():
    from stabench.suite import registry

    for name in sorted(registry.discover("task")):
        task = registry.get_task(name)
        budget = task.budget("quick")
        for cls in (CalibratedThreshold, Cusum, PageHinkley):
            detector = cls.for_task(task, budget)
            metric = task.detector.metric
            stream = [{metric: float(i % 3), "iteration": i} for i in range(budget.onset)]
            stream += [{metric: 1e3 + i, "iteration": budget.onset + i} for i in range(40)]
            for row in stream:
                detector.update(row)
            assert detector.onset == budget.onset and len(detector._seen) <= budget.onset, (name, cls.name)
            assert all(v < 3 for v in detector._seen), (name, cls.name)  # no post-onset value entered them
            if budget.onset < 2:  # reward-model-drift (onset 1): no statistics from one row, silent
                assert math.isnan(detector.sigma), name


@pytest.mark.parametrize("cls", [CalibratedThreshold, Cusum, PageHinkley])
def test_a_whole_run_at_once_raises_exactly_the_alarms_of_row_by_row_updates(cls):
    """`series` (what `replay_rules` uses) against `update` on random runs with missing values, shifts, flat
    warm-ups and onsets before, inside and after the warm-up: the same alarms, row for row."""
    rng = np.random.default_rng(7)
    compared = alarmed = 0
    for trial in range(300):
        n = int(rng.integers(0, 60))
        values = rng.normal(rng.normal(0, 5), rng.choice([1e-9, 0.1, 1.0, 10.0]), n)
        values += np.where(np.arange(n) >= rng.integers(0, 60), rng.normal(0, 8), 0.0)
        values[rng.random(n) < rng.choice([0.0, 0.2, 0.6])] = math.nan
        if trial % 10 == 0 and n:
            values[: n // 2] = 1.5  # a flat warm-up: the spread's floor
        warmup, onset = int(rng.integers(0, 12)), rng.choice([None, *range(0, 25)])
        above = bool(rng.integers(0, 2))
        streamed = cls("x", warmup, above=above, onset=onset)
        expected = np.array([streamed.update({"x": float(v)}) for v in values], dtype=bool)
        got = cls("x", warmup, above=above, onset=onset).series(values)
        assert got.dtype == bool and np.array_equal(got, expected), (trial, warmup, onset, above)
        compared, alarmed = compared + n, alarmed + int(expected.sum())
    assert alarmed > 0.05 * compared  # the comparison saw alarms, not only silence


def test_replay_rules_matches_feeding_each_run_row_by_row():
    """Runs shuffled in the table, iterations out of order, a rule without `series` and one whose column is not
    there: every rule's alarms are those of a fresh detector fed its run's rows in iteration order."""
    from functools import partial

    import pandas as pd
    from stabench.suite import registry
    from stabench.suite.api import ThresholdDetector
    from stabench.suite.detectors import replay_rules

    task = registry.get_task("policy-churn")
    metric = task.detector.metric
    rng = np.random.default_rng(3)
    runs = []
    for method in ("a", "b"):
        for seed in (0, 1, 2):
            for variant in ("control", "injected"):
                values = rng.normal(0, 1, 40) + np.where(np.arange(40) >= 20, 4.0 * (variant == "injected"), 0.0)
                values[rng.random(40) < 0.1] = math.nan
                runs.append(pd.DataFrame({"method": method, "seed": seed, "variant": variant,
                                          "iteration": np.arange(40), metric: values}))
    rows = pd.concat(runs, ignore_index=True).sample(frac=1.0, random_state=1)
    rules = {"ph": partial(PageHinkley, metric, 5, onset=20), "cusum-": partial(Cusum, metric, 5, above=False),
             "threshold": partial(ThresholdDetector, metric, 1.0), "absent": partial(Cusum, "no_such_column", 5)}
    got = replay_rules(rows, task, rules, [metric])
    for name, make in rules.items():
        expected = np.zeros(len(rows), bool)
        for _, run in rows.groupby(["method", "seed", "variant"]):
            run = run.sort_values("iteration")
            detector = make()
            alarms = [detector.update({metric: v}) for v in run[metric]]
            expected[rows.index.get_indexer(run.index)] = alarms
        assert np.array_equal(got[name], expected), name
    assert got["ph"].any() and got["threshold"].any() and not got["absent"].any()
