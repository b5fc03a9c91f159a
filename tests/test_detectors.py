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

    for name in sorted(registry.BUILTIN_TASKS):
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
