"""Detectors on constructed streams whose change point is known, and the detector score's anchors."""

import math

import numpy as np
import pandas as pd
import pytest

from suite import scoring
from suite.detectors import Always, CalibratedThreshold, Cusum, Never, PageHinkley, RandomAlarm

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
    rate = np.mean([RandomAlarm(0.1, seed=1).update({}) for _ in range(1)] +
                   [d.update({}) for d in [RandomAlarm(0.1, seed=2)] for _ in range(5000)])
    assert 0.08 < rate < 0.12


def _table(alarms_injected, alarms_control, failed=True, onset=4, n=10):
    rows = []
    for variant, alarms in (("injected", alarms_injected), ("control", alarms_control)):
        for i in range(n):
            ret = 0.0 if (variant == "injected" and failed and i >= onset) else 1.0
            rows.append({"task": "t", "task_ref": f"{__file__.rsplit('/', 1)[0]}/plugins/toy.py:ToyTask",
                         "method": "baseline", "role": "baseline", "seed": 0, "variant": variant, "iteration": i,
                         "step": 10 * (i + 1), "return": ret, "status": "ok", "onset_iteration": onset,
                         "iterations": n, "alarm/d": alarms[i]})
    return pd.DataFrame(rows)


def test_detector_score_anchors_and_false_alarm_rules():
    none = [False] * 10
    at_onset = [False] * 4 + [True] * 6
    late = [False] * 5 + [True] * 5  # inside the window [4, 6): the toy's window is 0.25 x 6 post-onset rows
    too_late = [False] * 9 + [True]  # after the window: a miss
    held = [True] * 10
    score = lambda inj, ctl: {r["detector"]: r for r in scoring.detector_track(_table(inj, ctl))}  # noqa: E731
    assert score(at_onset, none)["d"]["score"] == pytest.approx(100.0)
    assert score(at_onset, none)["oracle"]["score"] == pytest.approx(100.0)
    assert score(none, none)["d"]["score"] == 0.0
    assert 0 < score(late, none)["d"]["score"] < score(at_onset, none)["d"]["score"]
    assert score(too_late, none)["d"]["score"] == 0.0 and score(too_late, none)["d"]["detection_rate"] == 0.0
    held_score = score(held, held)["d"]
    assert held_score["score"] == 0.0 and held_score["detection_rate"] == 0.0  # held from before onset: no detection
    assert held_score["false_alarms_per_1k"] == pytest.approx(1000 * (4 + 10) / (4 + 10))
    with_false_alarm = score(at_onset, [False] * 6 + [True] + [False] * 3)["d"]
    assert with_false_alarm["score"] < 100.0 and with_false_alarm["false_alarms_per_1k"] > 0
    assert math.isnan(scoring.detector_track(_table(at_onset, none, failed=False))[0]["score"])
