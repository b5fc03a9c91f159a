"""The detector track's skill score on constructed tables (no training): its anchors and chance level, the
lead time, what a detector may read, and the replay of stored rows against the runner's alarm columns."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import detectors, formatting, leaderboard, registry, scoring, skill
from stabench.suite.api import StabenchError
from stabench.suite.trial import TrialSpec, run_trial

pytestmark = pytest.mark.smoke

ONSET, N = 10, 50  # post-onset horizon H = 40
H = N - ONSET


def make_table(runs: list[dict], alarms: dict[str, callable] | None = None) -> pd.DataFrame:
    """One toy run per entry {method, seed, variant, fails, drop}: return 1, or 0 from `drop` on a failing run.

    `alarms[name](run, it)` gives the `alarm/<name>` column of a run as a boolean array over iterations.
    """
    frames = []
    it = np.arange(N)
    for run in runs:
        drop = run.get("drop", ONSET)
        ret = np.where(run["fails"] & (it >= drop), 0.0, 1.0)
        frame = pd.DataFrame({"iteration": it, "step": 10 * (it + 1), "return": ret, "grad_norm_total": 1.0})
        for name, make in (alarms or {}).items():
            frame[f"alarm/{name}"] = make(run, it)
        frame = frame.assign(task="toy", task_ref=f"{TOY}:ToyTask", method=run["method"], seed=run["seed"],
                             variant=run["variant"], status="ok", onset_iteration=ONSET, iterations=N, tier="quick",
                             role="baseline" if run["method"] == "baseline" else "other", cell="")
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def grid(seeds: int = 20, healthy_share: float = 0.5) -> list[dict]:
    """The baseline fails every injected seed; the fix keeps `healthy_share` of its injected seeds healthy;
    every control stays healthy."""
    runs = []
    for seed in range(seeds):
        runs += [{"method": "baseline", "seed": seed, "variant": "injected", "fails": True},
                 {"method": "baseline", "seed": seed, "variant": "control", "fails": False},
                 {"method": "fix", "seed": seed, "variant": "injected", "fails": seed >= seeds * healthy_share},
                 {"method": "fix", "seed": seed, "variant": "control", "fails": False}]
    return runs


def scores(table: pd.DataFrame) -> dict[str, dict]:
    return {r["detector"]: r for r in skill.detector_track(table)}


def positive(run: dict) -> bool:
    return run["variant"] == "injected" and run["fails"]


def test_reference_anchors_oracle_injection_never_always():
    table = make_table(grid(), {"never": lambda r, it: np.zeros(N, bool), "always": lambda r, it: np.ones(N, bool),
                                "oracle-and-controls": lambda r, it: (it == ONSET) & (positive(r)
                                                                                       or r["variant"] == "control")})
    got = scores(table)
    assert got["oracle"]["score"] == pytest.approx(100.0)
    assert got["oracle"]["ci_low"] == got["oracle"]["ci_high"] == pytest.approx(100.0)
    assert abs(got["never"]["score"]) <= 5 and abs(got["always"]["score"]) <= 5
    # the fixes keep half their injected runs healthy: knowing the injection is worth 50, not 100
    assert got["injection"]["score"] == pytest.approx(50.0) and got["injection"]["score"] <= 60
    assert got["oracle-and-controls"]["score"] == pytest.approx(50.0) and got["oracle-and-controls"]["score"] <= 60
    assert got["oracle"]["n_failures"] == 20 + 10 and got["oracle"]["n_negatives"] == 40 + 10


def test_an_alarm_held_from_before_onset_counts_at_onset_and_a_failing_control_is_left_out():
    runs = grid(seeds=4) + [{"method": "other", "seed": 0, "variant": "control", "fails": True}]
    table = make_table(runs, {"held": lambda r, it: positive(r) | (it < ONSET)})
    got = scores(table)
    assert got["held"]["score"] == pytest.approx(100.0)  # held since iteration 0 on positives: credit at onset
    kinds = skill.detector_runs(table).query("detector == 'held'")["kind"].value_counts()
    assert kinds["excluded"] == 1 and kinds["positive"] == 4 + 2


def test_a_delayed_oracle_loses_strictly_with_every_iteration_over_the_whole_horizon():
    delays = list(range(H))

    def late(d: int):
        return lambda r, it: positive(r) & (it >= ONSET + d)

    alarms = {f"late-{d}": late(d) for d in delays}
    got = scores(make_table(grid(seeds=4), alarms))
    values = [got[f"late-{d}"]["score"] for d in delays]
    assert values[0] == pytest.approx(100.0)
    assert all(a > b for a, b in zip(values, values[1:])), values
    assert values[-1] > 0  # no cliff: the last iteration of the horizon still earns something
    assert got["late-20"]["score"] == pytest.approx(100 * (1 - 20 / H))


@pytest.mark.parametrize("rate", [0.01, 0.05, 0.20])
def test_random_alarms_at_any_rate_score_about_zero_on_many_runs(rate):
    """Independent streams per run (the harshest case: no common random numbers), 200 seeds per method."""
    rng = np.random.default_rng(int(rate * 1000))
    runs = grid(seeds=200)
    streams = {id(r): rng.random(N) < rate for r in runs}
    got = scores(make_table(runs, {"random": lambda r, it: streams[id(r)]}))["random"]
    assert abs(got["score"]) <= 10, got
    assert got["ci_low"] < 0 < got["ci_high"] or abs(got["score"]) < 3, got


def test_the_shipped_random_detectors_score_about_zero_when_replayed():
    table = detectors.replay_table(make_table(grid(seeds=20)), ["random-1", "random", "random-20", "never", "always"])
    got = scores(table)
    for name in ("random-1", "random", "random-20", "never", "always"):
        assert abs(got[name]["score"]) <= 10, (name, got[name]["score"])


def test_lead_time_on_a_hand_made_case():
    """The failing run's return falls from 1 to 0 at onset + 6: its 5-iteration mean is 0.8 there, already below
    the control's 1 minus 10% of (ceiling - floor), and stays so: the failure is visible at onset + 6."""
    runs = [{"method": "baseline", "seed": s, "variant": v, "fails": v == "injected", "drop": ONSET + 6}
            for s in range(3) for v in ("injected", "control")]
    early = {0: ONSET + 2, 1: ONSET + 3, 2: ONSET + 9}
    table = make_table(runs, {"d": lambda r, it: positive(r) & (it >= early[r["seed"]])})
    runs_frame = skill.detector_runs(table).query("detector == 'd' and kind == 'positive'").set_index("seed")
    assert list(runs_frame["visible_at"]) == [ONSET + 6] * 3
    assert list(runs_frame["lead"]) == [4, 3, -3]
    row = scores(table)["d"]
    assert row["median_lead"] == 3 and row["warned_before"] == pytest.approx(2 / 3) and row["n_lead"] == 3
    assert scores(table)["oracle"]["median_lead"] == 6


PEEK = '''
from stabench.suite.api import Detector
from tasks_toy import ToyTask


class Peek(Detector):
    """Alarms if anything privileged reaches it."""

    name = "peek"
    FORBIDDEN = ("return", "gt_secret", "secret_gold", "variant", "method", "seed", "phase", "diverged_at",
                 "status", "alarm/never")

    def update(self, row):
        return any(k in row for k in self.FORBIDDEN) or any(k.startswith("gt_") for k in row)


class Listed(ToyTask):
    privileged = ("secret_gold",)
'''


@pytest.fixture
def peek(tmp_path, monkeypatch):
    (tmp_path / "tasks_toy.py").write_text(open(TOY).read())
    (tmp_path / "peek.py").write_text(PEEK)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{tmp_path}/peek.py"


def test_a_detector_never_sees_privileged_columns(peek):
    table = make_table(grid(seeds=2), {"never": lambda r, it: np.zeros(N, bool)})
    table = table.assign(gt_secret=1.0, secret_gold=2.0, task_ref=f"{peek}:Listed")
    replayed = detectors.replay_table(table, [f"{peek}:Peek"])
    assert not replayed["alarm/peek"].any()
    task = registry.get_task(f"{peek}:Listed")
    row = detectors.visible_row(table.iloc[0].to_dict(), task)
    assert "grad_norm_total" in row and "iteration" in row and "step" in row
    assert not {"return", "gt_secret", "secret_gold", "variant", "alarm/never"} & set(row)
    # the trial itself feeds detectors the same stripped rows (the toy's rows carry `return`)
    trial = run_trial(TrialSpec(f"{peek}:Listed", "baseline", 0, "smoke", detectors=(f"{peek}:Peek", "never")))
    assert "return" in trial and not trial["alarm/peek"].any()


def test_replay_of_stored_rows_equals_the_runners_alarm_columns():
    """A real task's smoke run and the toy: every built-in detector replayed from the stored rows gives the
    runner's own alarm columns, row for row."""
    table = pd.concat([run_trial(TrialSpec("dead-layers", "baseline", 0, "smoke")),
                       run_trial(TrialSpec(f"{TOY}:ToyTask", "baseline", 1, "smoke"))], ignore_index=True)
    stored = table.copy()
    replayed = detectors.replay_table(stored, registry.DEFAULT_DETECTORS)
    for name in registry.DEFAULT_DETECTORS:
        assert (replayed[f"alarm/{name}"].to_numpy() == table[f"alarm/{name}"].to_numpy()).all(), name
    assert replayed["alarm/always"].all() and table["alarm/threshold"].dtype == bool


def test_score_replays_a_detector_file_and_refuses_bad_ones(tmp_path, capsys, peek):
    from stabench.suite.cli import main

    run = tmp_path / "run"
    run.mkdir()
    table = pd.concat([run_trial(TrialSpec(f"{TOY}:ToyTask", m, s, "smoke"))
                       for m in ("baseline", f"{TOY}:ToyFix") for s in (0, 1)], ignore_index=True)
    table.to_parquet(run / "metrics.parquet")
    capsys.readouterr()
    assert main(["score", str(run), "--json", "--detector", f"{peek}:Peek", "--detector", "random-20"]) == 0
    result = json.loads(capsys.readouterr().out)
    names = {r["detector"] for r in result["detector_track"]}
    assert {"peek", "random-20", "cusum", "oracle", "injection"} <= names
    before = (run / "metrics.parquet").read_bytes()
    for bad, message in ((f"{tmp_path}/missing.py:Nope", "does not exist"), ("oracle", "computed from the ground"),
                         (f"{TOY}:ToyFix", "is not a stabench.suite.api.Detector subclass")):
        assert main(["score", str(run), "--detector", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("stabench: error:") and message in err and err.count("\n") == 1, err
    assert (run / "metrics.parquet").read_bytes() == before


def test_leaderboard_rows_of_a_replayed_detector_equal_those_of_a_recorded_one(peek):
    table = pd.concat([run_trial(TrialSpec(f"{TOY}:ToyTask", m, s, "smoke"))
                       for m in ("baseline", f"{TOY}:ToyFix") for s in (0, 1)], ignore_index=True)
    manifest = {"spec": {"tier": "smoke"}, "suite_version": table["suite_version"].iloc[0]}
    recorded = leaderboard.compute_rows(table, manifest, [], ["cusum"])[0]
    replayed = leaderboard.compute_rows(table.drop(columns="alarm/cusum"), manifest, [], ["cusum"])[0]
    for field in ("per_task", "aggregate", "ci_low", "ci_high", "n_seeds", "version"):
        assert recorded[field] == replayed[field], field
    assert recorded["version"] == "builtin"
    row = leaderboard.compute_rows(table, manifest, [], [f"{peek}:Peek"])[0]
    assert row["name"] == "peek" and row["version"] == "1"
    with pytest.raises(StabenchError, match="is not in this run"):
        leaderboard.compute_rows(table, manifest, [], ["no-such-detector"])
    assert math.isfinite(float(recorded["aggregate"])) or recorded["aggregate"] == "nan"


def test_runs_of_the_reference_stabilizers_are_not_scored():
    """A learner that does not learn fails in both branches: neither a target nor a false alarm."""
    base = make_table(grid(seeds=4), {"oracle-like": lambda r, it: (it == ONSET) & positive(r)})
    refs = [{"method": "frozen-at-onset", "seed": s, "variant": v, "fails": True}
            for s in range(4) for v in ("injected", "control")]
    extra = make_table(refs, {"oracle-like": lambda r, it: np.zeros(N, bool)}).assign(role="reference")
    with_refs = pd.concat([base, extra], ignore_index=True)
    assert scores(with_refs)["oracle-like"]["score"] == pytest.approx(scores(base)["oracle-like"]["score"])
    assert "frozen-at-onset" not in set(skill.detector_runs(with_refs)["method"])


def test_split_detection_reads_one_rule_on_the_tool_state_diagnostic_and_on_its_aggregate():
    """Seed 004's comparison on a constructed table: the tool-state ratio tail jumps 5 iterations before a failing
    run's return drops, the aggregate (diluted by text tokens) barely moves; every rule sees the same runs."""
    from stabench.tasks.worlds import tool_detection

    rng = np.random.default_rng(0)
    runs = [{**run, "drop": ONSET + 10} for run in grid()]
    table = make_table(runs)
    jump = np.zeros(len(table))
    for run, (_, rows) in zip(runs, table.groupby(["method", "seed", "variant"], sort=False), strict=True):
        jump[rows.index] = np.where(positive(run) & (rows["iteration"] >= ONSET + 5), 5.0, 0.0)
    table["ratio_p99_tool"] = 1.2 + 0.05 * rng.standard_normal(len(table)) + jump
    table["ratio_p99"] = 1.1 + 0.05 * rng.standard_normal(len(table)) + 0.001 * jump
    frame = tool_detection.split_detection(table)
    assert set(frame["rule"]) == {"calibrated-threshold", "cusum", "page-hinkley"}
    assert set(frame["tool-state diagnostic"]) == {"ratio_p99_tool"}  # pairs the table lacks are left out
    assert (frame["split score"] > 50).all() and (frame["aggregate score"].abs() < 20).all()
    assert (frame["split median lead"] > 0).all()
    assert (tool_detection.split_detection_table(frame)["verdict"] == "split better").all()
    assert (frame["failing runs"] == 30).all()  # 20 baseline and 10 fix injected runs fail


def test_split_detection_summary_counts_verdicts_and_asks_for_an_earlier_warning():
    from stabench.tasks.worlds import tool_detection

    def row(split, agg, split_lead, agg_lead):
        return {"task": "t", "tool-state diagnostic": "ratio_p99_tool", "aggregate": "ratio_p99", "side": "above",
                "rule": "cusum", "split score": split, "split ci_low": split - 1, "split ci_high": split + 1,
                "split median lead": split_lead, "aggregate score": agg, "aggregate ci_low": agg - 1,
                "aggregate ci_high": agg + 1, "aggregate median lead": agg_lead, "failing runs": 3, "negative runs": 3}

    later = pd.DataFrame([row(50, 0, -2, 5), row(0, 40, 3, 3), row(10, 10.5, 1, 1)])
    text = tool_detection.split_detection_summary(later)
    assert text.startswith("Of 3 comparisons the tool-state reading is better in 1") and "the aggregate in 1" in text
    assert text.endswith("in none is the better tool-state reading also earlier than the failure and the aggregate")
    earlier = pd.DataFrame([row(50, 0, 6, 2)])
    assert tool_detection.split_detection_summary(earlier).endswith("in 1 it also warns earlier than both")
    assert "not tested" in tool_detection.split_detection_summary(pd.DataFrame())


def test_method_prior_leaves_the_scored_seed_out_and_never_alarms_on_a_control():
    outcome = {("a", 0): True, ("a", 1): True, ("a", 2): True, ("a", 3): False,  # a fails 3 of 4
               ("b", 0): True, ("b", 1): False, ("b", 2): False, ("b", 3): False,  # b fails 1 of 4
               ("c", 0): True, ("c", 1): False}  # c: with its own seed it would be a tie (never more than half)
    prior = skill.method_prior(outcome)
    assert [prior[("a", s)] for s in range(4)] == [True, True, True, True]  # seed 3's others: 3 of 3 failed
    assert not any(prior[("b", s)] for s in range(4))  # seed 0's others: 0 of 3
    assert prior[("c", 0)] is False and prior[("c", 1)] is True  # each seed reads only the other one
    runs = [{"method": m, "seed": s, "variant": v, "fails": v == "injected" and f}
            for (m, s), f in outcome.items() for v in ("injected", "control")]
    frame = skill.detector_runs(make_table(runs)).query("detector == 'method-prior'").set_index(
        ["method", "seed", "variant"])
    for (m, s), warns in prior.items():
        assert frame.loc[(m, s, "injected"), "detected"] == warns
        assert not frame.loc[(m, s, "control"), "detected"]
    row = scores(make_table(runs))["method-prior"]
    assert row["diagnostic"] == "the method's failures on other seeds (run metadata)"
    assert row["false_alarm_rate_control"] == 0.0 and row["false_alarm_rate_healthy_injected"] == pytest.approx(2 / 5)


def test_false_alarm_rate_counts_the_healthy_runs_with_an_alarm_after_onset():
    """20 seeds: the baseline fails every injected seed, the fix half; the detector alarms after onset on the controls
    of seeds 0-4 (of 40 controls: 5 baseline + 5 fix), on the fix's healthy injected seeds 0-1, and before onset only
    on every other run (that is no alarm after onset)."""
    def alarms(r, it):
        healthy = r["variant"] == "control" or not positive(r)
        late = healthy and ((r["variant"] == "control" and r["seed"] < 5) or
                            (r["variant"] == "injected" and r["seed"] < 2))
        return (it == ONSET + 3) & late | (it == ONSET - 2)

    table = make_table(grid(), {"d": alarms})
    row = scores(table)["d"]
    assert row["false_alarm_rate_control"] == pytest.approx(10 / 40)
    assert row["false_alarm_rate_healthy_injected"] == pytest.approx(2 / 10)
    assert row["false_alarm_rate"] == pytest.approx(12 / 50)
    summary = skill.alarm_summary(skill.detector_runs(table).query("detector == 'd'"))
    assert summary["false_alarm_rate"] == pytest.approx(12 / 50) and summary["per_task"]["toy"] == [0.24, None]
    assert summary["median_lead"] is None  # it never warns a failing run
    result = scoring.score(table)
    assert "false_alarm_rate  median_lead" in formatting.format_table(result)
    assert "| false_alarm_rate | median_lead |" in formatting.format_markdown(result)


def test_leaderboard_detector_rows_carry_false_alarms_and_lead_and_are_read_against_method_prior(tmp_path):
    table = pd.concat([run_trial(TrialSpec(f"{TOY}:ToyTask", m, s, "smoke"))
                       for m in ("baseline", f"{TOY}:ToyFix") for s in (0, 1)], ignore_index=True)
    manifest = {"spec": {"tier": "smoke"}, "suite_version": table["suite_version"].iloc[0]}
    rows = leaderboard.compute_rows(table, manifest, [], ["cusum", "method-prior"])
    alarms = json.loads(rows[0]["failures"])
    assert set(alarms) == {"false_alarm_rate", "median_lead", "per_task"} and set(alarms["per_task"]) == {"toy"}
    assert 0 <= alarms["false_alarm_rate"] <= 1 and rows[1]["name"] == "method-prior"
    leaderboard.render_markdown(rows, tmp_path / "LEADERBOARD.md")
    text = (tmp_path / "LEADERBOARD.md").read_text()
    assert "Read against `method-prior`" in text and "cusum 0/1 (false alarms" in text
