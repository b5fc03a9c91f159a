"""Cross-fitting learned detectors, and the built-in learned reference `logistic-z`.

A learned detector declares a fit step (`Detector.fit(rows, task, budget) -> state`, `Detector.load(state)`; see
`suite.api.Detector`). On the committed method matrix a method's majority outcome predicts 96.7% of its injected
runs, so a detector fitted on the runs it is scored on could earn most of the score by recognizing the method. The
harness therefore never fits on what it scores (`replay_learned`), per task (and grid cell):

- the runs the track scores (`skill.detector_rows`) are split into `FOLDS` folds of seeds (sorted seeds, seed i
  in fold i mod K) crossed with the methods: the runs of method m on the seeds of fold f are scored by a detector
  fitted on the runs of every *other* method on the seeds *outside* fold f (K-fold over seeds crossed with
  leave-one-method-out); both variants of a seed go together;
- the fit sees the training runs' visible rows (`suite.detectors.visible_frame`) with `run` (an integer per run)
  and `label` (1: an injected run that failed, 0: a run that stayed healthy, control or injected; a control that
  failed is left out), never the method, seed or variant;
- with one method or one seed nothing is left to fit on: the fit receives no rows.

`in_sample=True` fits once on every run of the task, the scored ones included: a contrast for reports (how much a
learned detector would earn by memorizing), never a score.

`logistic-z` (a reference, not a tuned detector): per task, an L2-regularized logistic regression, class-balanced,
on clipped one-sided z-scores of every visible diagnostic. Features of a row: for each visible column except
`iteration` and `step`, z = (x - healthy mean) / healthy spread, the healthy statistics measured on the run's own
pre-onset rows (the first `onset` rows; at least `MIN_HEALTHY` finite values, spread floored as the built-ins do,
else the column's features are 0), then max(z, 0) and max(-z, 0), each clipped at `BAND` (8); a missing value
gives 0. Fitted on the post-onset rows of the training runs (at most `FIT_ROWS` per run, evenly spaced); its alarm
threshold on the predicted log-odds is the one that maximizes the track's timed skill on the training runs (mean
credit over failing runs minus mean credit over healthy ones). It alarms from the onset on, when a row's log-odds
exceed the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from stabench.suite.api import Budget, Detector, StabenchError, Task

FOLDS = 5
BAND = 8.0
FIT_ROWS = 30
RIDGE = 1e-3
CLOCK = ("iteration", "step")


def is_learned(cls: type) -> bool:
    """True for a detector class that overrides `Detector.fit`."""
    fit = getattr(cls, "fit", None)
    return fit is not None and getattr(fit, "__func__", fit) is not Detector.fit.__func__


def seed_folds(seeds, k: int = FOLDS) -> dict[int, int]:
    """Seed -> fold: the sorted distinct seeds dealt round-robin into min(k, number of seeds) folds."""
    ordered = sorted(set(seeds))
    k = max(1, min(k, len(ordered)))
    return {seed: i % k for i, seed in enumerate(ordered)}


def training_keys(scored: tuple[str, int], keys, folds: Mapping[int, int]) -> list[tuple]:
    """The runs (method, seed, variant) a detector scoring method `scored[0]` on fold `scored[1]` is fitted on: every
    other method's runs on the seeds outside that fold."""
    method, fold = scored
    return [key for key in keys if key[0] != method and folds[key[1]] != fold]


def replay_learned(table: pd.DataFrame, ref: str, in_sample: bool = False) -> np.ndarray:
    """The alarms (one bool per row of `table`, in its order) of the learned detector `ref`, cross-fitted as the
    module docstring says; rows the track does not score (the references', a method's copies of the baseline's)
    get none. Errors in the plugin's own code are one line naming it."""
    from stabench.suite import detectors, outcomes, registry, skill

    cls = registry.resolve_class("detector", ref)
    alarms = np.zeros(len(table), dtype=bool)
    rows = skill.detector_rows(table)
    if rows.empty:
        return alarms
    if "tier" not in rows:
        raise StabenchError("the table has no `tier` column: is it the metrics.parquet of a `stabench run`?")
    position = pd.Series(np.arange(len(table)), index=table.index)
    failed = {(r.task, r.method, r.seed, r.variant): bool(r.failed) for r in outcomes.outcomes(rows).itertuples()}
    rows = rows.assign(_cell=rows["cell"].fillna("") if "cell" in rows else "")
    tasks: dict[str, Task] = {}
    for (name, cell), task_rows in rows.groupby(["task", "_cell"], sort=True):
        task_id = f"{name} [{cell}]" if cell else name
        task = outcomes.task_of(task_rows, cell, tasks)
        budget = task.budget(str(task_rows["tier"].iloc[0]))
        runs = {key: run.sort_values("iteration").drop(columns="_cell")
                for key, run in task_rows.groupby(["method", "seed", "variant"], sort=True)}
        labels = {}
        for key in runs:
            fails = failed.get((task_id, *key), False)
            labels[key] = (1 if fails else 0) if key[2] == "injected" else (None if fails else 0)
        frames, owners = [], []
        for i, (key, run) in enumerate(runs.items()):
            if labels[key] is None:
                continue
            frame = detectors.visible_frame(run, task).reset_index(drop=True)
            frames.append(frame.assign(run=i, label=labels[key]))
            owners += [key] * len(frame)
        pool = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run", "label"])
        owner_method = np.array([k[0] for k in owners], dtype=object)
        owner_seed = np.array([k[1] for k in owners])
        folds = seed_folds([k[1] for k in runs])
        owner_fold = np.array([folds[s] for s in owner_seed], dtype=int)
        states: dict[tuple, Any] = {}
        for key, run in runs.items():
            group = ("all",) if in_sample else (key[0], folds[key[1]])
            if group not in states:
                mask = (np.ones(len(pool), bool) if in_sample
                        else (owner_method != key[0]) & (owner_fold != folds[key[1]]))
                states[group] = _fit(cls, pool[mask].reset_index(drop=True), task, budget)
            detector = registry.make_detector(ref, task, budget)
            try:
                got = detectors.replay_fitted(detector, task, run, detectors.run_key(task, cell, key[1]),
                                              states[group], learned=True)
            except StabenchError:
                raise
            except Exception as exc:  # the plugin's own code failed: one line naming it and the run
                raise StabenchError(f"detector {cls.name!r} raised on {task_id} {key[0]} seed {key[1]} {key[2]}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            alarms[position[run.index].to_numpy()] = got
    return alarms


def _fit(cls: type, rows: pd.DataFrame, task: Task, budget: Budget) -> Any:
    try:
        return cls.fit(rows, task, budget)
    except StabenchError:
        raise
    except Exception as exc:
        raise StabenchError(f"detector {cls.name!r}: fit raised on {task.id}: {type(exc).__name__}: {exc}") from exc


# ---- the built-in learned reference ------------------------------------------------------------------------------

def healthy_columns(values: np.ndarray, onset: int) -> tuple[np.ndarray, np.ndarray]:
    """Per column of a run's values (rows in iteration order), the healthy mean and spread from its first `onset`
    rows, as `suite.detectors.healthy_stats` computes them; NaN where fewer than `MIN_HEALTHY` values are finite."""
    from stabench.suite.detectors import MIN_HEALTHY

    head = values[:onset]
    finite = np.isfinite(head)
    n = finite.sum(axis=0)
    enough = n >= MIN_HEALTHY
    with np.errstate(invalid="ignore", divide="ignore"):
        mu = np.where(finite, head, 0.0).sum(axis=0) / n
        var = np.where(finite, (head - mu) ** 2, 0.0).sum(axis=0) / (n - 1)
        sigma = np.maximum(np.maximum(np.sqrt(var), 0.05 * np.abs(mu)), 1e-8)
    return np.where(enough, mu, np.nan), np.where(enough, sigma, np.nan)


def band_features(values: np.ndarray, mu: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """max(z, 0) and max(-z, 0) of z = (x - mu) / sigma, clipped at `BAND`; a missing z gives 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        z = (values - mu) / sigma
    z = np.nan_to_num(z, nan=0.0, posinf=BAND, neginf=-BAND)
    return np.concatenate([np.clip(z, 0.0, BAND), np.clip(-z, 0.0, BAND)], axis=-1)


def _logistic(x: np.ndarray, y: np.ndarray, weight: np.ndarray, ridge: float = RIDGE) -> np.ndarray:
    """Weighted L2-regularized logistic regression by Newton's method; the last coefficient is the intercept
    (unpenalized)."""
    x = np.hstack([x, np.ones((len(x), 1))])
    beta = np.zeros(x.shape[1])
    penalty = np.full(x.shape[1], ridge)
    penalty[-1] = 1e-9
    for _ in range(50):
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ beta, -30, 30)))
        grad = x.T @ (weight * (p - y)) + penalty * beta
        hess = (x * (weight * p * (1 - p))[:, None]).T @ x + np.diag(penalty)
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.max(np.abs(step)) < 1e-6:
            break
    return beta


class LogisticZ(Detector):
    """The learned reference: logistic regression on clipped one-sided z-scores of every visible diagnostic
    against the run's own pre-onset rows (`suite.crossfit`). Never alarms before onset, nor unfitted."""

    name = "logistic-z"

    def __init__(self, onset: int, columns: tuple[str, ...] = ()) -> None:
        self.onset, self.columns = onset, columns
        self.state: dict | None = None
        self._healthy: list[np.ndarray] = []
        self._rows = 0
        self.mu = self.sigma = None

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> LogisticZ:
        return cls(budget.onset)

    @classmethod
    def fit(cls, rows: pd.DataFrame, task: Task, budget: Budget) -> dict | None:
        onset, horizon = budget.onset, budget.iterations - budget.onset
        columns = [c for c in rows.columns if c not in (*CLOCK, "run", "label")
                   and pd.api.types.is_numeric_dtype(rows[c]) and rows[c].notna().any()]
        if rows.empty or not columns:
            return None
        rows = rows.sort_values(["run", "iteration"] if "iteration" in rows else ["run"], kind="stable")
        values, run_ids = rows[columns].to_numpy(float), rows["run"].to_numpy()
        starts = np.flatnonzero(np.r_[True, run_ids[1:] != run_ids[:-1]])
        ends = np.r_[starts[1:], len(run_ids)]
        label_of = rows["label"].to_numpy(int)
        fit_x, fit_y, posts, labels = [], [], [], []
        for a, b in zip(starts, ends):
            run = values[a:b]
            post = band_features(run, *healthy_columns(run, onset))[onset:]
            if not len(post):
                continue
            stride = max(1, math.ceil(len(post) / FIT_ROWS))
            fit_x.append(post[::stride])
            fit_y.append(np.full(len(fit_x[-1]), float(label_of[a])))
            posts.append(post)
            labels.append(int(label_of[a]))
        labels = np.array(labels)
        if not (labels == 1).any() or not (labels == 0).any():
            return None
        x, y = np.vstack(fit_x), np.concatenate(fit_y)
        weight = np.where(y == 1, 0.5 / (y == 1).sum(), 0.5 / (y == 0).sum())
        beta = _logistic(x, y, weight)
        scores = [post @ beta[:-1] + beta[-1] for post in posts]
        candidates = np.unique(np.quantile(np.concatenate(scores), np.linspace(0.0, 1.0, 101)))[::-1]
        # the first row above each candidate threshold, per run: where the running maximum first exceeds it
        first = np.stack([np.searchsorted(np.maximum.accumulate(s), candidates, side="right") for s in scores])
        lengths = np.array([len(s) for s in scores])[:, None]
        credit = np.where(first < lengths, 1.0 - np.minimum(first, horizon) / horizon, 0.0)
        skill = credit[labels == 1].mean(axis=0) - credit[labels == 0].mean(axis=0)
        best = int(np.argmax(skill))  # the highest candidate among the best: a tie keeps the fewer alarms
        if skill[best] <= 0:  # no threshold beats silence on the training runs: never alarm
            return {"columns": columns, "coef": beta[:-1].tolist(), "intercept": float(beta[-1]),
                    "threshold": math.inf, "training_skill": 0.0}
        return {"columns": columns, "coef": beta[:-1].tolist(), "intercept": float(beta[-1]),
                "threshold": float(candidates[best]), "training_skill": float(skill[best])}

    def load(self, state: Any) -> None:
        self.state = state
        if state is not None:
            self.columns = tuple(state["columns"])
            self._coef = np.asarray(state["coef"], float)

    def update(self, row: Mapping[str, float]) -> bool:
        self._rows += 1
        if self.state is None:
            return False
        values = np.array([_number(row.get(c)) for c in self.columns], float)
        if self._rows <= self.onset:
            self._healthy.append(values)
            return False
        if self.mu is None:
            head = np.vstack(self._healthy) if self._healthy else np.empty((0, len(self.columns)))
            self.mu, self.sigma = healthy_columns(head, self.onset)
        score = float(band_features(values, self.mu, self.sigma) @ self._coef) + self.state["intercept"]
        return score > self.state["threshold"]


def _number(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
