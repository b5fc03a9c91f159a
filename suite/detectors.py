"""The detector library: streaming rules that read one diagnostic, one row at a time, and raise alarms.

Each detector reads the diagnostic its task pairs with detectors (`Task.detector.metric`) unless it is
given another. Missing values (NaN) never raise an alarm and do not update the detector's state.
Warm-up windows are counted in rows seen with a finite value; a detector learns "healthy" from the
first `warmup` of them (by default half the tier's onset), never from the onset itself.

Reference detectors anchor the score scale: `never` (no alarm), `always` (alarm every row), `random-1`,
`random` (5%) and `random-20` (alarm with that probability per row, one seeded stream per run), which
all score about 0 in expectation; `oracle` (the ground truth: alarms at onset on the injected runs
that fail, 100) and `injection` (alarms at onset on every injected run: it knows the injection, not the
outcome). The last two are computed from the run's metadata in `suite.scoring`, never from rows.

What a detector sees: `visible_row` strips every privileged or bookkeeping column from a stored row
before `Detector.update` (see `suite.api.Detector`), and `replay` runs a detector over one run's rows.
The runner's trial writes its `alarm/<name>` columns with `replay`, and `stabench score --detector`
uses the same function on a finished run's stored rows, so both give the same alarms.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Iterable, Mapping
from typing import ClassVar

import numpy as np
import pandas as pd
from stabench.suite.api import Budget, Detector, StabenchError, Task, ThresholdDetector

# Columns the harness adds to a run's rows (who, where, what happened): never a detector's input.
BOOKKEEPING = frozenset({
    "task", "task_ref", "task_version", "family", "method", "method_ref", "role", "seed", "tier",
    "onset_iteration", "iterations", "suite_version", "config_hash", "cell", "variant", "status", "error",
    "phase", "diverged_at",
})


def privileged_columns(task: Task) -> frozenset[str]:
    """What the task's ground truth is made of: `return`, the ground-truth metric, `Task.privileged`."""
    return frozenset({"return", task.ground_truth.metric, *getattr(task, "privileged", ())})


def hidden(column: str, task: Task) -> bool:
    """True for a column no detector may read (privileged, a `gt_*` column, bookkeeping or an alarm)."""
    return (column in privileged_columns(task) or column.startswith(("gt_", "alarm/", "knob_"))
            or column in BOOKKEEPING)


def visible_frame(run: pd.DataFrame, task: Task) -> pd.DataFrame:
    """One run's rows (iteration order) as a detector sees them: hidden columns and empty ones dropped."""
    keep = [c for c in run.columns if not hidden(str(c), task)]
    return run[keep].dropna(axis=1, how="all")


def visible_row(row: Mapping[str, object], task: Task) -> dict[str, object]:
    """One row as a detector sees it."""
    return {k: v for k, v in row.items() if not hidden(str(k), task)}


def run_key(task: Task, cell: str, seed: int) -> str:
    """The seed of a randomized detector's stream: one per (task, cell, seed). Every method and both
    branches of a seed share it (common random numbers: the branches share their healthy phase, and
    the key must not tell a detector which branch it is on), so a detector blind to the outcome earns
    the same credit on a seed's positives and negatives and its score stays near 0 with few seeds."""
    return f"{task.id}|{cell}|{int(seed)}"


def replay(ref: str, task: Task, budget: Budget, run: pd.DataFrame, key: str) -> np.ndarray:
    """The alarms (one bool per row, in the rows' order) of a fresh detector fed one run's visible rows."""
    from stabench.suite import registry

    detector = registry.make_detector(ref, task, budget)
    if hasattr(detector, "reseed"):
        detector.reseed(key)
    rows = visible_frame(run, task).to_dict("records")
    return np.array([bool(detector.update(r)) for r in rows], dtype=bool)


def replay_table(table: pd.DataFrame, refs: Iterable[str]) -> pd.DataFrame:
    """A copy of a finished run's table with an `alarm/<name>` column per detector, replayed from its
    stored rows (an existing column of that name is replaced). Errors are one line for the user."""
    from stabench.suite import registry
    from stabench.suite.scoring import task_of  # scoring (scipy) stays out of the trial's imports

    refs = list(refs)
    names = {}
    for ref in refs:
        name = registry.resolve_class("detector", ref).name
        if name in registry.SCORED_DETECTORS:
            raise StabenchError(f"{name!r} is computed from the ground truth at scoring time, not replayed")
        names[ref] = name
    out = table.copy()
    cells = out["cell"].fillna("") if "cell" in out else pd.Series("", index=out.index)
    keys = ["task", "method", "seed", "variant"]
    tasks: dict[str, Task] = {}
    columns = {name: np.zeros(len(out), dtype=bool) for name in names.values()}
    position = pd.Series(np.arange(len(out)), index=out.index)
    for (task_id, cell, method, seed, variant), run in out.assign(_cell=cells).groupby(
            ["task", "_cell", *keys[1:]], sort=True):
        task = task_of(run, cell, tasks)
        if "tier" not in run:
            raise StabenchError("the table has no `tier` column: is it the metrics.parquet of a `stabench run`?")
        budget = task.budget(str(run["tier"].iloc[0]))
        run = run.sort_values("iteration").drop(columns="_cell")
        for det_ref, name in names.items():
            try:
                alarms = replay(det_ref, task, budget, run, run_key(task, cell, seed))
            except StabenchError:
                raise
            except Exception as exc:  # the plugin's own code failed: one line naming it and the run
                raise StabenchError(f"detector {name!r} raised on {task_id} {method} seed {seed} {variant}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            columns[name][position[run.index].to_numpy()] = alarms
    for name, values in columns.items():
        out[f"alarm/{name}"] = values
    return out


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
    """Alarm with probability `rate` per row (5%), one seeded stream per run (see `run_key`)."""

    name = "random"
    rate: ClassVar[float] = 0.05

    def __init__(self, rate: float | None = None, seed: int = 0) -> None:
        self.rate, self.rng = type(self).rate if rate is None else rate, random.Random(seed)

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> RandomAlarm:
        return cls(seed=zlib.crc32(task.id.encode()))

    def reseed(self, run_key: str) -> None:
        """Each run gets its own stream (one shared stream would make every run lucky or unlucky at once)."""
        self.rng = random.Random(zlib.crc32(f"{self.name}|{run_key}".encode()))

    def update(self, row: Mapping[str, float]) -> bool:
        return self.rng.random() < self.rate


class RandomAlarm1(RandomAlarm):
    """Alarm with probability 1% per row."""

    name = "random-1"
    rate = 0.01


class RandomAlarm20(RandomAlarm):
    """Alarm with probability 20% per row."""

    name = "random-20"
    rate = 0.20


class Oracle(Detector):
    """Placeholder in streams: the oracle's alarms come from the ground truth at scoring time."""

    name = "oracle"

    def update(self, row: Mapping[str, float]) -> bool:
        return False


class Injection(Detector):
    """Placeholder in streams: alarms at onset on every injected run, computed at scoring time. It knows
    that the injection happened, not whether the run fails: the score it earns is what the track does
    not reward (at most 50 where the fixes keep their injected runs healthy)."""

    name = "injection"

    def update(self, row: Mapping[str, float]) -> bool:
        return False


__all__ = ["Always", "CalibratedThreshold", "Cusum", "Injection", "Never", "Oracle", "PageHinkley", "RandomAlarm",
           "RandomAlarm1", "RandomAlarm20", "ThresholdDetector", "replay", "replay_table", "visible_row"]
