"""The detector library: streaming rules that read one diagnostic, one row at a time, and raise alarms.

Each detector reads the diagnostic its task pairs with detectors (`Task.detector.metric`) unless it is
given another. Missing values (NaN) never raise an alarm and do not update the detector's state.
Warm-up windows are counted in rows seen with a finite value; a detector learns "healthy" from the
first `warmup` of them (by default half the tier's onset), never from the onset itself.

Reference detectors anchor the score scale: `never` (no alarm), `always` (alarm every row), `random`
(alarm with a fixed probability per row, seeded) and `oracle` (reads the ground truth: it is scored
from the run's outcome in `suite.scoring`, alarming exactly at onset on runs that fail).
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Mapping

from suite.api import Budget, Detector, Task, ThresholdDetector


def _value(row: Mapping[str, float], metric: str) -> float:
    value = row.get(metric, math.nan)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return math.nan
    return value


def default_warmup(budget: Budget) -> int:
    return max(3, budget.onset // 2)


class _Standardized(Detector):
    """Learns the mean and spread of the first `warmup` finite values, then sees standardized values."""

    def __init__(self, metric: str, warmup: int) -> None:
        self.metric, self.warmup = metric, warmup
        self._seen: list[float] = []
        self.mu = self.sigma = math.nan

    def standardize(self, row: Mapping[str, float]) -> float:
        x = _value(row, self.metric)
        if not math.isfinite(x):
            return math.nan
        if len(self._seen) < self.warmup:
            self._seen.append(x)
            if len(self._seen) == self.warmup:
                self.mu = sum(self._seen) / len(self._seen)
                var = sum((v - self.mu) ** 2 for v in self._seen) / max(1, len(self._seen) - 1)
                # a floor on sigma: a perfectly flat warm-up must not turn noise into alarms
                self.sigma = max(math.sqrt(var), 0.05 * abs(self.mu), 1e-8)
            return math.nan
        return (x - self.mu) / self.sigma


class CalibratedThreshold(_Standardized):
    """Alarm when the diagnostic leaves mean +/- k standard deviations of the warm-up window (k = 4)."""

    name = "calibrated-threshold"

    def __init__(self, metric: str, warmup: int, k: float = 4.0, above: bool = True) -> None:
        super().__init__(metric, warmup)
        self.k, self.above = k, above

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> CalibratedThreshold:
        return cls(task.detector.metric, default_warmup(budget), above=task.detector.above)

    def update(self, row: Mapping[str, float]) -> bool:
        z = self.standardize(row)
        return math.isfinite(z) and (z > self.k if self.above else z < -self.k)


class Cusum(_Standardized):
    """One-sided CUSUM on the standardized diagnostic: S = max(0, S + z - k); alarm while S > h.

    k = 0.5 and h = 5 (in warm-up standard deviations), as in Page's chart; the side is the task's.
    """

    name = "cusum"

    def __init__(self, metric: str, warmup: int, k: float = 0.5, h: float = 5.0, above: bool = True) -> None:
        super().__init__(metric, warmup)
        self.k, self.h, self.above, self.s = k, h, above, 0.0

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> Cusum:
        return cls(task.detector.metric, default_warmup(budget), above=task.detector.above)

    def update(self, row: Mapping[str, float]) -> bool:
        z = self.standardize(row)
        if not math.isfinite(z):
            return False
        self.s = max(0.0, self.s + (z if self.above else -z) - self.k)
        return self.s > self.h


class PageHinkley(_Standardized):
    """Page-Hinkley on the standardized diagnostic: m_t = sum of (z_t - mean_t - delta); alarm when
    m_t - min_s m_s > lambda (delta = 0.5, lambda = 8, in warm-up standard deviations).
    """

    name = "page-hinkley"

    def __init__(self, metric: str, warmup: int, delta: float = 0.5, lam: float = 8.0, above: bool = True) -> None:
        super().__init__(metric, warmup)
        self.delta, self.lam, self.above = delta, lam, above
        self.n, self.mean, self.m, self.m_min = 0, 0.0, 0.0, 0.0

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> PageHinkley:
        return cls(task.detector.metric, default_warmup(budget), above=task.detector.above)

    def update(self, row: Mapping[str, float]) -> bool:
        z = self.standardize(row)
        if not math.isfinite(z):
            return False
        z = z if self.above else -z
        self.n += 1
        self.mean += (z - self.mean) / self.n
        self.m += z - self.mean - self.delta
        self.m_min = min(self.m_min, self.m)
        return self.m - self.m_min > self.lam


class Never(Detector):
    name = "never"

    def update(self, row: Mapping[str, float]) -> bool:
        return False


class Always(Detector):
    name = "always"

    def update(self, row: Mapping[str, float]) -> bool:
        return True


class RandomAlarm(Detector):
    """Alarm with probability `rate` per row; seeded by the task so that runs are reproducible."""

    name = "random"

    def __init__(self, rate: float = 0.05, seed: int = 0) -> None:
        self.rate, self.rng = rate, random.Random(seed)

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> RandomAlarm:
        return cls(seed=zlib.crc32(task.id.encode()))

    def reseed(self, run_key: str) -> None:
        """Each run gets its own stream (one shared stream would make every run lucky or unlucky at once)."""
        self.rng = random.Random(zlib.crc32(run_key.encode()))

    def update(self, row: Mapping[str, float]) -> bool:
        return self.rng.random() < self.rate


class Oracle(Detector):
    """Placeholder in streams: the oracle's alarms come from the ground truth at scoring time."""

    name = "oracle"

    def update(self, row: Mapping[str, float]) -> bool:
        return False


__all__ = ["Always", "CalibratedThreshold", "Cusum", "Never", "Oracle", "PageHinkley", "RandomAlarm",
           "ThresholdDetector"]
