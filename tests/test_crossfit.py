"""Learned detectors are cross-fitted (`suite.crossfit`): never fitted on the method or the seeds they score, so
memorizing methods earns nothing; and the learned reference reads a failure that every method shares. Constructed
tables, no training."""

import math

import numpy as np
import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import crossfit, detectors, registry, skill
from stabench.suite.api import Detector, StabenchError

pytestmark = pytest.mark.smoke

ONSET, N = 10, 30  # the toy task's quick budget


def make_table(methods: int = 12, seeds: int = 10, fails=lambda k, s: k % 2 == 0, signal: bool = False,
               rng_seed: int = 0) -> pd.DataFrame:
    """Method k's runs: a visible `level` 10 k (+ noise) that fingerprints the method, a `code` 1000 k + seed that
    names the run, and (with `signal`) a `signal` that jumps at onset + 2 on every failing run, whatever the method.
    The injected run of method k, seed s fails when `fails(k, s)`; controls stay healthy."""
    rng = np.random.default_rng(rng_seed)
    it = np.arange(N)
    frames = []
    for k in range(methods):
        for seed in range(seeds):
            for variant in ("injected", "control"):
                failing = variant == "injected" and fails(k, seed)
                frame = pd.DataFrame({
                    "iteration": it, "step": 10 * (it + 1),
                    "return": np.where(failing & (it >= ONSET), 0.0, 1.0),
                    "level": 10.0 * k + 0.1 * rng.standard_normal(N), "code": 1000.0 * k + seed,
                    "grad_norm_total": 1.0 + 0.1 * rng.standard_normal(N)})
                if signal:
                    frame["signal"] = rng.standard_normal(N) + np.where(failing & (it >= ONSET + 2), 6.0, 0.0)
                frames.append(frame.assign(
                    task="toy", task_ref=f"{TOY}:ToyTask", method=f"m{k:02d}", seed=seed, variant=variant,
                    status="ok", onset_iteration=ONSET, iterations=N, tier="quick",
                    role="baseline" if k == 0 else "other", cell=""))
    return pd.concat(frames, ignore_index=True)


class Memorize(Detector):
    """Memorizes method outcomes the only way it can: by the fingerprint a visible column leaves (`level` rounded),
    the share of failing runs it saw under each; alarms from onset on a run whose fingerprint mostly failed."""

    name = "memorize"

    def __init__(self, onset: int) -> None:
        self.onset, self.rows, self.mark, self.rates = onset, 0, None, {}

    @classmethod
    def for_task(cls, task, budget):
        return cls(budget.onset)

    @classmethod
    def fit(cls, rows, task, budget):
        if rows.empty:
            return {}
        runs = rows.groupby("run").agg(level=("level", "first"), label=("label", "first"))
        return runs.groupby(runs["level"].round(-1))["label"].mean().to_dict()

    def load(self, state):
        self.rates = state or {}

    def update(self, row):
        self.rows += 1
        if self.mark is None:
            self.mark = round(float(row["level"]), -1)
        return self.rows > self.onset and self.rates.get(self.mark, 0.0) > 0.25


class Spy(Detector):
    """Alarms on every row if its fit saw a run of its own method or its own seed, or saw nothing."""

    name = "spy"

    def __init__(self) -> None:
        self.seen, self.own = set(), None

    @classmethod
    def fit(cls, rows, task, budget):
        return sorted({int(c) for c in rows["code"]}) if len(rows) else []

    def load(self, state):
        self.seen = set(state)

    def update(self, row):
        own = int(row["code"])
        return (not self.seen or any(c // 1000 == own // 1000 or c % 1000 == own % 1000 for c in self.seen))


@pytest.fixture
def plugins(monkeypatch):
    """The test's detectors, resolvable by name like a plugin."""
    known = {"memorize": Memorize, "spy": Spy}
    resolve = registry.resolve_class
    monkeypatch.setattr(registry, "resolve_class",
                        lambda kind, name: known[name] if kind == "detector" and name in known else resolve(kind, name))


def score_of(table: pd.DataFrame, name: str) -> dict:
    return next(r for r in skill.detector_track(table) if r["detector"] == name)


def test_folds_cross_seeds_with_left_out_methods():
    folds = crossfit.seed_folds(range(10))
    assert sorted(folds.values()) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    keys = [(m, s, v) for m in ("a", "b", "c") for s in range(10) for v in ("injected", "control")]
    train = crossfit.training_keys(("a", folds[3]), keys, folds)
    assert train and not {k for k in train if k[0] == "a" or folds[k[1]] == folds[3]}
    assert len(train) == 2 * 8 * 2  # two other methods, eight seeds, both variants
    assert crossfit.seed_folds([7]) == {7: 0} and crossfit.is_learned(Memorize) and not crossfit.is_learned(Detector)


def test_crossfit_never_fits_on_the_scored_method_or_seeds(plugins):
    table = make_table(methods=3, seeds=5)
    crossfitted = detectors.replay_table(table, ["spy"])
    assert not crossfitted["alarm/spy"].any()  # every run's fit saw other methods' runs on other seeds only
    assert detectors.replay_table(table, ["spy"], in_sample=True)["alarm/spy"].all()  # the spy works


def test_memorizing_methods_scores_about_chance_cross_fitted_and_high_in_sample(plugins):
    table = make_table()
    crossfitted = score_of(detectors.replay_table(table, ["memorize"]), "memorize")
    in_sample = score_of(detectors.replay_table(table, ["memorize"], in_sample=True), "memorize")
    assert abs(crossfitted["score"]) <= 5, crossfitted
    assert in_sample["score"] >= 60, in_sample
    # the reference that knows the method, for scale: it is what memorizing would earn
    assert score_of(table, "method-prior")["score"] >= 70


def test_the_learned_reference_reads_a_failure_every_method_shares():
    table = make_table(methods=4, seeds=10, fails=lambda k, s: (k + s) % 3 == 0, signal=True)
    got = score_of(detectors.replay_table(table, ["logistic-z"]), "logistic-z")
    assert got["score"] >= 70 and got["false_alarm_rate"] <= 0.2, got
    assert got["diagnostic"] == "every visible diagnostic (cross-fitted)"


def test_the_learned_reference_learns_healthy_only_from_pre_onset_rows():
    detector = crossfit.LogisticZ(onset=3)
    detector.load({"columns": ["x"], "coef": [1.0, 0.0], "intercept": 0.0, "threshold": 4.0})
    rows = [{"x": v} for v in (1.0, 2.0, 3.0, 1000.0, 1000.0)]
    alarms = [detector.update(r) for r in rows]
    assert detector.mu[0] == pytest.approx(2.0) and detector.sigma[0] == pytest.approx(1.0)
    assert alarms == [False, False, False, True, True]
    lone = crossfit.LogisticZ(onset=1)  # one pre-onset row: no healthy statistics, the feature is 0
    lone.load({"columns": ["x"], "coef": [1.0, 0.0], "intercept": 0.0, "threshold": -1.0})
    assert [lone.update(r) for r in rows] == [False, True, True, True, True]
    assert math.isnan(lone.mu[0])
    features = crossfit.band_features(np.array([[5.0], [np.nan]]), np.array([1.0]), np.array([0.5]))
    assert features.tolist() == [[8.0, 0.0], [0.0, 0.0]]  # z = 8 clipped at the band; missing: 0


def test_a_learned_detector_is_not_recorded_by_a_run_and_its_errors_are_one_line(plugins):
    task = registry.get_task(f"{TOY}:ToyTask")
    with pytest.raises(StabenchError, match="is learned"):
        detectors.replay("logistic-z", task, task.budget("quick"), make_table(1, 1).head(N), "k")

    class Broken(Memorize):
        name = "broken"

        @classmethod
        def fit(cls, rows, task, budget):
            raise ValueError("nope")

    with pytest.raises(StabenchError, match="'broken': fit raised on toy: ValueError: nope"):
        crossfit._fit(Broken, pd.DataFrame(), task, task.budget("quick"))


def test_a_run_refuses_a_learned_detector_in_one_line(tmp_path, capsys):
    from stabench.suite.cli import main

    out = tmp_path / "run"
    assert main(["run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask", "--detector", "logistic-z",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stabench: error:") and "is learned" in err and err.count("\n") == 1, err
    assert not out.exists()
