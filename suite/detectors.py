"""The detector library: streaming rules that read one diagnostic, one row at a time, and raise alarms.

Each detector reads the diagnostic its task pairs with detectors (`Task.detector.metric`) unless it is
given another. Missing values (NaN) never raise an alarm and do not update the detector's state.
Warm-up windows are counted in rows seen with a finite value; a detector learns "healthy" from the
first `warmup` of them (by default half the tier's onset, at least 3), and only from rows before the onset: the
warm-up is capped at the onset (the first `onset` rows a detector receives are the pre-onset iterations, one row
per iteration from 0). Where the onset leaves fewer finite values than `warmup`, the statistics come from those
there are; fewer than `MIN_HEALTHY` (2: reward-model-drift, onset 1, has one pre-onset row) leave the detector
without healthy statistics, and it never alarms on that run.

Reference detectors anchor the score scale: `never` (no alarm), `always` (alarm every row), `random-1`,
`random` (5%) and `random-20` (alarm with that probability per row, one seeded stream per run), which
all score about 0 in expectation; `oracle` (the ground truth: alarms at onset on the injected runs
that fail, 100) and `injection` (alarms at onset on every injected run: it knows the injection, not the
outcome). The last two are computed from the run's metadata in `suite.skill`, never from rows.

Reference `method-prior` (computed at scoring time too) reads no diagnostic: it alarms at onset on an injected
run when its method's injected runs on the task's other seeds mostly failed, never on a control. A detector that
scores no better than it has shown nothing a method's name would not tell.

What a detector sees: `visible_row` / `visible_frame` give a stored row as the task's visible schema
(`suite.visibility`: the diagnostics the task's baseline fills, no configuration column; the same columns whatever
method runs, missing ones NaN) before `Detector.update` (see `suite.api.Detector`), and `replay` runs a detector
over one run's rows. A learned detector (one that declares `Detector.fit`) is replayed by `replay_table` through
`suite.crossfit`: fitted on other methods' runs and other seeds than those it scores.
The runner's trial writes its `alarm/<name>` columns with `replay`, and `stabench score --detector`
uses the same function on a finished run's stored rows, so both give the same alarms.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

import numpy as np
import pandas as pd
from stabench.suite.api import Budget, Detector, StabenchError, Task, ThresholdDetector
from stabench.suite.visibility import configuration_columns, visible_columns

# Columns the harness adds to a run's rows (who, where, what happened): never a detector's input.
BOOKKEEPING = frozenset({
    "task", "task_ref", "task_version", "family", "method", "method_ref", "role", "seed", "tier",
    "onset_iteration", "iterations", "suite_version", "config_hash", "cell", "variant", "status", "error",
    "phase", "diverged_at",
})


def privileged_columns(task: Task) -> frozenset[str]:
    """What the task's ground truth is made of: `return`, the ground-truth metric, `Task.privileged`."""
    return frozenset({"return", task.ground_truth.metric, *getattr(task, "privileged", ())})


def hidden(column: str, task: Task, schema: bool = True) -> bool:
    """True for a column no detector may read: privileged, a `gt_*` column, bookkeeping, an alarm, a knob, a
    configuration column (`suite.visibility.configuration_columns`) and, with `schema`, any column outside the
    task's visible schema (`suite.visibility.visible_columns`) where it has one."""
    if (column in privileged_columns(task) or column.startswith(("gt_", "alarm/", "knob_"))
            or column in BOOKKEEPING or column in configuration_columns(task)):
        return True
    columns = visible_columns(task) if schema else None
    return columns is not None and column not in columns


def _schema(task: Task) -> list[str] | None:
    """The task's visible schema less anything hidden by name (a plugin's `Task.visible` may list one)."""
    columns = visible_columns(task)
    return None if columns is None else [c for c in columns if not hidden(c, task, schema=False)]


def visible_frame(run: pd.DataFrame, task: Task) -> pd.DataFrame:
    """One run's rows (iteration order) as a detector sees them: the task's visible schema, in its order, a column
    the run does not fill NaN; a task without a schema (a plugin): every column that is not hidden."""
    columns = _schema(task)
    if columns is not None:
        return run.reindex(columns=columns)
    return run[[c for c in run.columns if not hidden(str(c), task)]]


def visible_row(row: Mapping[str, object], task: Task) -> dict[str, object]:
    """One row as a detector sees it (`visible_frame`)."""
    columns = _schema(task)
    if columns is not None:
        return {c: row.get(c, math.nan) for c in columns}
    return {k: v for k, v in row.items() if not hidden(str(k), task)}


def run_key(task: Task, cell: str, seed: int) -> str:
    """The seed of a randomized detector's stream: one per (task, cell, seed). Every method and both
    branches of a seed share it (common random numbers: the branches share their healthy phase, and
    the key must not tell a detector which branch it is on), so a detector blind to the outcome earns
    the same credit on a seed's positives and negatives and its score stays near 0 with few seeds."""
    return f"{task.id}|{cell}|{int(seed)}"


def replay(ref: str, task: Task, budget: Budget, run: pd.DataFrame, key: str) -> np.ndarray:
    """The alarms (one bool per row, in the rows' order) of a fresh detector fed one run's visible rows."""
    from stabench.suite import crossfit, registry

    if crossfit.is_learned(registry.resolve_class("detector", ref)):
        raise StabenchError(f"detector {ref!r} is learned (it declares `fit`): it is scored cross-fitted over a "
                            "finished run's stored rows (`stabench score DIR --detector ...`), not recorded by a run")
    return replay_fitted(registry.make_detector(ref, task, budget), task, run, key)


def replay_fitted(detector: Detector, task: Task, run: pd.DataFrame, key: str, state: object = None,
                  learned: bool = False) -> np.ndarray:
    """`replay` with a built detector; a learned one receives `state` (what its `fit` returned) first."""
    if learned:
        detector.load(state)
    if hasattr(detector, "reseed"):
        detector.reseed(key)
    rows = visible_frame(run, task).to_dict("records")
    return np.array([bool(detector.update(r)) for r in rows], dtype=bool)


def replay_table(table: pd.DataFrame, refs: Iterable[str], in_sample: bool = False) -> pd.DataFrame:
    """A copy of a finished run's table with an `alarm/<name>` column per detector, replayed from its
    stored rows (an existing column of that name is replaced). Errors are one line for the user. A learned
    detector is cross-fitted (`suite.crossfit`); `in_sample` fits it on every run of the task instead, the scored
    ones included (a contrast for reports, never a score)."""
    from stabench.suite import crossfit, registry
    from stabench.suite.outcomes import task_of

    refs = list(refs)
    names, learned = {}, {}
    for ref in refs:
        cls = registry.resolve_class("detector", ref)
        if cls.name in registry.SCORED_DETECTORS:
            raise StabenchError(f"{cls.name!r} is computed from the ground truth at scoring time, not replayed")
        (learned if crossfit.is_learned(cls) else names)[ref] = cls.name
    out = table.copy()
    for ref, name in learned.items():
        out[f"alarm/{name}"] = crossfit.replay_learned(out, ref, in_sample=in_sample)
    cells = out["cell"].fillna("") if "cell" in out else pd.Series("", index=out.index)
    keys = ["task", "method", "seed", "variant"]
    tasks: dict[str, Task] = {}
    columns = {name: np.zeros(len(out), dtype=bool) for name in names.values()}
    position = pd.Series(np.arange(len(out)), index=out.index)
    groups = out.assign(_cell=cells).groupby(["task", "_cell", *keys[1:]], sort=True) if names else []
    for (task_id, cell, method, seed, variant), run in groups:
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


def replay_rules(rows: pd.DataFrame, task: Task, rules: Mapping[str, Callable[[], Detector]],
                 metrics: Iterable[str]) -> dict[str, np.ndarray]:
    """Per named rule, its alarms over every run of one task's rows (one bool per row, in the rows' order): a fresh
    detector (`rules[name]()`) per run, fed the run's rows in iteration order as `visible_frame` shows them, of
    which only `metrics`, the columns the rules read, are handed over (a study of built-in rules on a wide table).
    A rule that offers `series` (the built-in change rules) reads its numeric column a run at once, with the alarms
    `update` would raise row by row; any other is fed the rows one at a time."""
    shown = set(visible_frame(rows.iloc[:0], task).columns)
    names = [m for m in dict.fromkeys(metrics) if m in shown and m in rows]
    numeric = {m: rows[m].to_numpy(dtype=float, na_value=np.nan) for m in names
               if pd.api.types.is_numeric_dtype(rows[m])}
    out = {name: np.zeros(len(rows), bool) for name in rules}
    codes = [pd.factorize(rows[key], sort=True)[0] for key in ("method", "seed", "variant")]
    order = np.lexsort((rows["iteration"].to_numpy(dtype=float, na_value=np.nan), *codes[::-1]))
    order = order[(np.stack(codes) >= 0).all(axis=0)[order]]  # a run with a missing key is not a run
    run_codes = np.stack(codes)[:, order]
    cuts = np.flatnonzero((run_codes[:, 1:] != run_codes[:, :-1]).any(axis=0)) + 1
    for where in np.split(order, cuts) if len(order) else []:
        records = None
        for name, make in rules.items():
            detector = make()
            metric = getattr(detector, "metric", None)
            if hasattr(detector, "series") and (metric in numeric or metric not in names):
                series = numeric[metric][where] if metric in numeric else np.full(len(where), math.nan)
                out[name][where] = detector.series(series)
                continue
            if records is None:
                records = rows[names].iloc[where].to_dict("records")
            out[name][where] = [detector.update(r) for r in records]
    return out


def _value(row: Mapping[str, float], metric: str) -> float:
    value = row.get(metric, math.nan)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return math.nan
    return value


MIN_HEALTHY = 2  # the fewest healthy values a spread is estimated from


def default_warmup(budget: Budget) -> int:
    return max(3, budget.onset // 2)


def healthy_stats(values: list[float]) -> tuple[float, float]:
    """Mean and spread of healthy values (NaN, NaN from fewer than `MIN_HEALTHY`); the spread has a floor, 5% of
    |mean| (1e-8 at least): a perfectly flat warm-up must not turn noise into alarms."""
    if len(values) < MIN_HEALTHY:
        return math.nan, math.nan
    mu = sum(values) / len(values)
    var = sum((v - mu) ** 2 for v in values) / (len(values) - 1)
    return mu, max(math.sqrt(var), 0.05 * abs(mu), 1e-8)


class _Standardized(Detector):
    """Learns the mean and spread of the first `warmup` finite values among the first `onset` rows (the pre-onset
    iterations; no cap when `onset` is None), then sees standardized values. With fewer than `MIN_HEALTHY` healthy
    values it has no statistics and every value standardizes to NaN (never an alarm)."""

    def __init__(self, metric: str, warmup: int, onset: int | None = None) -> None:
        self.metric, self.warmup, self.onset = metric, warmup, onset
        self._seen: list[float] = []
        self._rows, self._ready = 0, False
        self.mu = self.sigma = math.nan

    def standardize(self, row: Mapping[str, float]) -> float:
        self._rows += 1
        x = _value(row, self.metric)
        if not self._ready:
            if self.onset is None or self._rows <= self.onset:  # a pre-onset row: still healthy
                if math.isfinite(x):
                    self._seen.append(x)
                    if len(self._seen) == self.warmup:
                        self._ready = True
                        self.mu, self.sigma = healthy_stats(self._seen)
                return math.nan
            self._ready = True  # the onset came first: the statistics of the healthy values there are
            self.mu, self.sigma = healthy_stats(self._seen)
        if not (math.isfinite(x) and math.isfinite(self.sigma)):
            return math.nan
        return (x - self.mu) / self.sigma

    def standardize_series(self, values: np.ndarray) -> np.ndarray:
        """What `standardize` returns, row by row from a fresh state, over one run's values at once (a run's
        `metric` column, iteration order): the same healthy values, the same statistics, the same float arithmetic.
        Leaves the detector's state untouched."""
        x = np.asarray(values, dtype=float)
        pre = len(x) if self.onset is None else min(max(self.onset, 0), len(x))
        finite = np.flatnonzero(np.isfinite(x[:pre]))
        if 0 < self.warmup <= len(finite):  # the warm-up filled before the onset: ready after its last value
            healthy, start = finite[:self.warmup], int(finite[self.warmup - 1]) + 1
        else:  # the onset came first (or the run ended): ready from the onset row on
            healthy, start = finite, pre if self.onset is not None else len(x)
        mu, sigma = healthy_stats(x[healthy].tolist())
        z = np.full(len(x), math.nan)
        if math.isfinite(sigma):
            with np.errstate(invalid="ignore", over="ignore"):
                z[start:] = (x[start:] - mu) / sigma
        return z


class CalibratedThreshold(_Standardized):
    """Alarm when the diagnostic leaves mean +/- k standard deviations of the warm-up window (k = 4)."""

    name = "calibrated-threshold"

    def __init__(self, metric: str, warmup: int, k: float = 4.0, above: bool = True, onset: int | None = None) -> None:
        super().__init__(metric, warmup, onset)
        self.k, self.above = k, above

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> CalibratedThreshold:
        return cls(task.detector.metric, default_warmup(budget), above=task.detector.above, onset=budget.onset)

    def update(self, row: Mapping[str, float]) -> bool:
        z = self.standardize(row)
        return math.isfinite(z) and (z > self.k if self.above else z < -self.k)

    def series(self, values: np.ndarray) -> np.ndarray:
        """The alarms `update` raises fed `values` one row at a time from a fresh state."""
        z = self.standardize_series(values)
        with np.errstate(invalid="ignore"):
            return np.isfinite(z) & (z > self.k if self.above else z < -self.k)


class Cusum(_Standardized):
    """One-sided CUSUM on the standardized diagnostic: S = max(0, S + z - k); alarm while S > h.

    k = 0.5 and h = 5 (in warm-up standard deviations), as in Page's chart; the side is the task's.
    """

    name = "cusum"

    def __init__(self, metric: str, warmup: int, k: float = 0.5, h: float = 5.0, above: bool = True,
                 onset: int | None = None) -> None:
        super().__init__(metric, warmup, onset)
        self.k, self.h, self.above, self.s = k, h, above, 0.0

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> Cusum:
        return cls(task.detector.metric, default_warmup(budget), above=task.detector.above, onset=budget.onset)

    def update(self, row: Mapping[str, float]) -> bool:
        z = self.standardize(row)
        if not math.isfinite(z):
            return False
        self.s = max(0.0, self.s + (z if self.above else -z) - self.k)
        return self.s > self.h

    def series(self, values: np.ndarray) -> np.ndarray:
        """The alarms `update` raises fed `values` one row at a time from a fresh state: the recursion runs in
        Python floats over the finite standardized values only, in the same order, so every sum is the same."""
        z = self.standardize_series(values)
        at = np.flatnonzero(np.isfinite(z))
        out = np.zeros(len(z), dtype=bool)
        k, h, s, alarms = self.k, self.h, 0.0, []
        for v in (z[at] if self.above else -z[at]).tolist():
            s = max(0.0, s + v - k)
            alarms.append(s > h)
        out[at] = alarms
        return out


class PageHinkley(_Standardized):
    """Page-Hinkley on the standardized diagnostic: m_t = sum of (z_t - mean_t - delta); alarm when
    m_t - min_s m_s > lambda (delta = 0.5, lambda = 8, in warm-up standard deviations).
    """

    name = "page-hinkley"

    def __init__(self, metric: str, warmup: int, delta: float = 0.5, lam: float = 8.0, above: bool = True,
                 onset: int | None = None) -> None:
        super().__init__(metric, warmup, onset)
        self.delta, self.lam, self.above = delta, lam, above
        self.n, self.mean, self.m, self.m_min = 0, 0.0, 0.0, 0.0

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> PageHinkley:
        return cls(task.detector.metric, default_warmup(budget), above=task.detector.above, onset=budget.onset)

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

    def series(self, values: np.ndarray) -> np.ndarray:
        """The alarms `update` raises fed `values` one row at a time from a fresh state (the recursion in Python
        floats over the finite standardized values, in order, as `Cusum.series`)."""
        z = self.standardize_series(values)
        at = np.flatnonzero(np.isfinite(z))
        out = np.zeros(len(z), dtype=bool)
        delta, lam, n, mean, m, m_min, alarms = self.delta, self.lam, 0, 0.0, 0.0, 0.0, []
        for v in (z[at] if self.above else -z[at]).tolist():
            n += 1
            mean += (v - mean) / n
            m += v - mean - delta
            m_min = min(m_min, m)
            alarms.append(m - m_min > lam)
        out[at] = alarms
        return out


class Never(Detector):
    name = "never"

    def update(self, row: Mapping[str, float]) -> bool:
        return False


class Always(Detector):
    name = "always"

    def update(self, row: Mapping[str, float]) -> bool:
        return True


class _RandomAlarm(Detector):
    """Alarm with probability `rate` per row, one seeded stream per run (see `run_key`). The rates below are in
    the order runs record them (discovery reads the source in order)."""

    rate: ClassVar[float]

    def __init__(self, rate: float | None = None, seed: int = 0) -> None:
        self.rate, self.rng = type(self).rate if rate is None else rate, random.Random(seed)

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> _RandomAlarm:
        return cls(seed=zlib.crc32(task.id.encode()))

    def reseed(self, run_key: str) -> None:
        """Each run gets its own stream (one shared stream would make every run lucky or unlucky at once)."""
        self.rng = random.Random(zlib.crc32(f"{self.name}|{run_key}".encode()))

    def update(self, row: Mapping[str, float]) -> bool:
        return self.rng.random() < self.rate


class RandomAlarm1(_RandomAlarm):
    """Alarm with probability 1% per row."""

    name = "random-1"
    rate = 0.01


class RandomAlarm(_RandomAlarm):
    """Alarm with probability 5% per row (or the `rate` it is built with)."""

    name = "random"
    rate = 0.05


class RandomAlarm20(_RandomAlarm):
    """Alarm with probability 20% per row."""

    name = "random-20"
    rate = 0.20


class Oracle(Detector):
    """Placeholder in streams: the oracle's alarms come from the ground truth at scoring time."""

    name = "oracle"
    from_metadata = True

    def update(self, row: Mapping[str, float]) -> bool:
        return False


class Injection(Detector):
    """Placeholder in streams: alarms at onset on every injected run, computed at scoring time. It knows
    that the injection happened, not whether the run fails: the score it earns is what the track does
    not reward (at most 50 where the fixes keep their injected runs healthy)."""

    name = "injection"
    from_metadata = True

    def update(self, row: Mapping[str, float]) -> bool:
        return False


class MethodPrior(Detector):
    """Placeholder in streams: computed at scoring time from the run's metadata. It alarms at onset on an injected
    run when its method's injected runs of the task on the other seeds (its own left out) mostly failed (more than
    half), never on a control: it knows which method ran and how that method fares, and reads no diagnostic. A
    detector that does not beat it has not shown that it reads the failure rather than the method."""

    name = "method-prior"
    from_metadata = True

    def update(self, row: Mapping[str, float]) -> bool:
        return False


__all__ = ["Always", "CalibratedThreshold", "Cusum", "Injection", "MethodPrior", "Never", "Oracle", "PageHinkley",
           "RandomAlarm", "RandomAlarm1", "RandomAlarm20", "ThresholdDetector", "replay", "replay_table",
           "visible_frame", "visible_row"]
