"""The harness on a toy task whose behaviour is known: registries, branching, divergence, scoring."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TOY
from stabench.suite import outcomes, registry, scoring, statistics
from stabench.suite.api import Budget, GroundTruth, StabenchError, TrainState
from stabench.suite.diagnostics import (
    DIAGNOSTICS,
    DiagnosedRun,
    dormant_share,
    effective_rank,
    per_layer_grad_norms,
    total_grad_norm,
)
from stabench.suite.runner import ExperimentSpec, TrialSpec, run_trial

pytestmark = pytest.mark.smoke


def toy_trial(method: str = "baseline", seed: int = 0) -> pd.DataFrame:
    return run_trial(TrialSpec(f"{TOY}:ToyTask", method, seed, "smoke"))


def test_trial_shares_the_healthy_phase_and_branches_at_onset():
    table = toy_trial()
    inj = table[table.variant == "injected"].set_index("iteration")
    ctl = table[table.variant == "control"].set_index("iteration")
    onset = int(table.onset_iteration.iloc[0])
    assert len(inj) == len(ctl) == int(table.iterations.iloc[0])
    pd.testing.assert_series_equal(inj.loc[: onset - 1, "w"], ctl.loc[: onset - 1, "w"])
    assert (inj.loc[: onset - 1, "phase"] == "healthy").all()
    assert not np.allclose(inj.loc[onset:, "w"], ctl.loc[onset:, "w"])
    # the injected shock raises the gradient norm; the threshold detector sees it only after onset
    assert not inj.loc[: onset - 1, "alarm/threshold"].any()
    assert inj.loc[onset:, "alarm/threshold"].all() and not ctl["alarm/threshold"].any()


def test_same_seed_same_rows_and_other_seed_other_rows():
    a, b, c = toy_trial(seed=3), toy_trial(seed=3), toy_trial(seed=4)
    pd.testing.assert_frame_equal(a, b)
    assert not np.allclose(a["w"], c["w"])


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        ("Raising", "raising at iteration 0: raising.advantages raised RuntimeError: boom"),
        ("NaNLoss", "nan-loss at iteration 0: nan-loss.loss produced a non-finite term 'bad'"),
        ("WrongType", "wrong-type at iteration 0: wrong-type.advantages returned list, expected a torch.Tensor"),
    ],
)
def test_a_failing_plugin_is_a_diverged_run_named_by_plugin(plugin, message):
    table = toy_trial(f"{TOY}:{plugin}")
    assert set(table.variant) == {"injected", "control"}  # recorded, not dropped
    assert (table.status == "diverged").all()
    assert (table.error == message).all()
    assert (table.diverged_at == 0).all()


def test_registry_resolves_builtins_files_and_reports_bad_references(tmp_path):
    assert registry.resolve_class("stabilizer", "baseline").__name__ == "Stabilizer"
    assert registry.method_name(f"{TOY}:ToyFix") == "toy-fix"
    with pytest.raises(StabenchError, match="unknown task 'nope'"):
        registry.get_task("nope")
    with pytest.raises(StabenchError, match="does not exist"):
        registry.resolve_class("stabilizer", str(tmp_path / "missing.py") + ":X")
    with pytest.raises(StabenchError, match="has no 'Missing'"):
        registry.resolve_class("stabilizer", f"{TOY}:Missing")
    with pytest.raises(StabenchError, match="is not a stabench.suite.api.Stabilizer subclass"):
        registry.resolve_class("stabilizer", f"{TOY}:NotAStabilizer")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ValueError('bad plugin')\n")
    with pytest.raises(StabenchError, match="failed to import: ValueError: bad plugin"):
        registry.resolve_class("stabilizer", f"{broken}:X")


def test_experiment_grid_and_its_checks():
    spec = ExperimentSpec(tier="smoke", tasks=(f"{TOY}:ToyTask",), methods=("baseline", f"{TOY}:ToyFix"), seeds=3)
    trials = spec.trials()
    assert len(trials) == 6 and {t.seed for t in trials} == {0, 1, 2}
    with pytest.raises(StabenchError, match="unknown tier"):
        ExperimentSpec(tier="huge", tasks=(f"{TOY}:ToyTask",)).trials()
    with pytest.raises(StabenchError, match="unknown stabilizer"):
        ExperimentSpec(tier="smoke", tasks=(f"{TOY}:ToyTask",), methods=("nope",)).trials()
    with pytest.raises(StabenchError, match="onset 9 must lie strictly inside"):
        Budget(iterations=9, onset=9, seeds=1)


def test_failure_rules_on_hand_built_runs():
    rows = pd.DataFrame({"iteration": range(8), "return": [1, 1, 1, 1, 1, 1, 0.2, 0.2], "status": "ok"})
    tail = GroundTruth("return", 0.5, "below", "tail_mean", tail=0.25)
    assert outcomes.run_failed(rows, tail, onset=4, iterations=8)
    assert not outcomes.run_failed(rows.assign(**{"return": 1.0}), tail, onset=4, iterations=8)
    spike = GroundTruth("return", 0.9, "above", "any")
    assert not outcomes.run_failed(rows.assign(**{"return": [1, 0, 0, 0, 0, 0, 0, 0]}), spike, 1, 8)  # before onset
    assert outcomes.run_failed(rows.assign(**{"return": [0, 0, 0, 0, 0, 1, 0, 0]}), spike, 1, 8)
    assert outcomes.run_failed(rows.assign(status="diverged"), spike, 1, 8)


def test_diverged_runs_count_their_missing_iterations_at_the_floor():
    task = registry.get_task(f"{TOY}:ToyTask")
    rows = pd.DataFrame({"iteration": [0, 1, 2, 3], "return": [1.0, 1.0, 1.0, np.nan], "diverged_at": 3.0})
    # onset 2, 6 iterations: iteration 2 reached (1.0), iterations 3-5 never reached (floor 0)
    assert outcomes.post_onset_return(rows, task, onset=2, iterations=6) == pytest.approx(0.25)


def test_score_table_on_toy_runs_separates_fix_from_baseline():
    table = pd.concat([toy_trial(m, s) for m in ("baseline", f"{TOY}:ToyFix") for s in (0, 1)])
    result = {r["method"]: r for r in scoring.score(table)["stabilizer_track"]}
    assert result["baseline"]["role"] == "baseline" and result["toy-fix"]["role"] == "matched-fix"
    assert result["baseline"]["failure_rate"] == 1.0 and result["toy-fix"]["failure_rate"] == 0.0
    assert result["baseline"]["control_failure_rate"] == 0.0
    assert result["toy-fix"]["ci_low"] > result["baseline"]["ci_high"]
    assert result["toy-fix"]["n_seeds"] == 2


def test_bootstrap_interval_contains_the_mean_and_is_reproducible():
    values = np.array([0.1, 0.4, 0.35, 0.8, 0.5])
    low, high = statistics.bootstrap_mean_ci(values)
    assert low < values.mean() < high
    assert (low, high) == statistics.bootstrap_mean_ci(values)
    assert statistics.bootstrap_mean_ci(np.array([0.3, 0.3])) == (0.3, 0.3)


def test_per_layer_grad_norms_on_known_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1, bias=False))
    model[0].weight.grad = torch.full((3, 2), 2.0)  # norm sqrt(6 * 4)
    model[0].bias.grad = torch.full((3,), 1.0)  # adds 3
    norms = per_layer_grad_norms(model)
    assert list(norms) == ["0", "2"]
    assert norms["0"] == pytest.approx(math.sqrt(27))
    assert math.isnan(norms["2"])  # no gradient: missing, not zero
    assert total_grad_norm(norms) == pytest.approx(math.sqrt(27))


def test_effective_rank_and_dormant_share_on_constructed_cases():
    rank1 = torch.outer(torch.arange(1.0, 9.0), torch.ones(4))
    assert effective_rank(rank1) == pytest.approx(1.0, abs=1e-6)
    assert effective_rank(torch.eye(5)) == pytest.approx(5.0)
    assert math.isnan(effective_rank(torch.zeros(3, 3)))
    acts = torch.ones(10, 4)
    acts[:, 0] = 0.0  # one unit never fires
    assert dormant_share(acts) == 0.25


def test_a_no_op_stabilizer_lands_in_the_baseline_interval_and_self_improvement_is_one_half():
    runs = [toy_trial(m, s) for m in ("baseline", f"{TOY}:NoOp", f"{TOY}:ToyFix") for s in range(4)]
    table = pd.concat(runs)
    per_run = outcomes.outcomes(table)
    track = {r["method"]: r for r in statistics.stabilizer_track(table, per_run)}
    base, noop = track["baseline"], track["no-op"]
    assert base["ci_low"] <= noop["normalized_return"] <= base["ci_high"]
    assert noop["failure_rate"] == base["failure_rate"]
    agg = {r["method"]: r for r in statistics.across_tasks(per_run)}
    assert agg["no-op"]["probability_of_improvement"] == pytest.approx(0.5)
    assert agg["baseline"]["probability_of_improvement"] == pytest.approx(0.5)
    assert agg["toy-fix"]["probability_of_improvement"] == 1.0


def test_probability_of_improvement_of_a_method_against_a_copy_of_itself_is_one_half_within_noise():
    """Two methods drawn from the same distribution, 20 times: the estimate centres on 0.5 and its 95%
    stratified interval covers 0.5 in most draws."""
    rng = np.random.default_rng(0)
    estimates, covered = [], 0
    for _ in range(20):
        rows = [{"task": t, "method": m, "seed": s, "variant": "injected", "normalized_return": rng.normal(0.5, 0.1)}
                for t in ("a", "b", "c") for m in ("x", "baseline") for s in range(10)]
        x = {r["method"]: r for r in statistics.across_tasks(pd.DataFrame(rows))}["x"]
        estimates.append(x["probability_of_improvement"])
        covered += x["poi_ci_low"] <= 0.5 <= x["poi_ci_high"]
        assert x["ci_low"] < x["iqm"] < x["ci_high"] and x["n_tasks"] == 3
    assert abs(np.mean(estimates) - 0.5) < 0.05
    assert covered >= 17


def test_an_installed_package_entry_point_is_found_by_name(tmp_path, monkeypatch):
    """A package that declares `stabench.stabilizers` and `stabench.tasks` entry points is usable by name."""
    (tmp_path / "outside_fix.py").write_text(
        "from stabench.suite.api import Stabilizer\n\nclass OutsideFix(Stabilizer):\n    name = 'outside-fix'\n"
    )
    dist = tmp_path / "outside_fix-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-fix\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[stabench.stabilizers]\noutside-fix = outside_fix:OutsideFix\n\n[stabench.tasks]\ntoy-task = toy:ToyTask\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(TOY).parent))
    assert "outside-fix" in registry.names("stabilizer") and "toy-task" in registry.names("task")
    assert registry.make_stabilizer("outside-fix").name == "outside-fix"
    assert registry.get_task("toy-task").id == "toy"


def test_a_named_grid_expands_into_one_trial_per_cell_and_seed():
    spec = ExperimentSpec(tier="quick", tasks=("parallel-staleness",), methods=("baseline",), seeds=2,
                          grid="staleness")
    trials = spec.trials()
    cells = {t.knobs for t in trials}
    assert len(cells) == 18 and len(trials) == 36  # 3 env counts x 3 epoch counts x 2 lags, 2 seeds each
    assert all(dict(k)["num_envs"] * dict(k)["num_steps"] == 512 for k in cells)  # batch fixed across cells
    with pytest.raises(StabenchError, match="has no grid named 'nope'"):
        ExperimentSpec(tier="quick", tasks=("parallel-staleness",), grid="nope").trials()
    with pytest.raises(StabenchError, match="no requested task has a grid named 'nope2'"):
        ExperimentSpec(tier="smoke", tasks=(f"{TOY}:ToyTask", "parallel-staleness"), grid="nope2").trials()


def test_a_trial_with_knobs_records_its_cell():
    table = run_trial(TrialSpec("parallel-staleness", "baseline", 0, "smoke", knobs=(("lag", 4),)))
    assert (table["cell"] == "lag=4").all() and (table["knob_lag"] == 4).all()
    result = outcomes.outcomes(table)
    assert set(result["task"]) == {"parallel-staleness [lag=4]"}


def test_a_run_gets_its_declared_diagnostics_from_the_harness_once_after_its_own_columns(monkeypatch):
    """`DiagnosedRun.step` computes each declared diagnostic once per iteration, from the state `train` returned, and
    appends its columns after the task's own, in the declared order; no task computes them itself."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    grads = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    state = TrainState(model, {}, grads, {}, {"activations": [torch.tensor([[0.0, 1.0, 2.0], [0.0, 3.0, 2.0]])]})
    calls = []
    for name in ("grad_norms", "dormant"):
        fn = DIAGNOSTICS[name]
        monkeypatch.setitem(DIAGNOSTICS, name, lambda st, fn=fn, name=name: calls.append((name, st)) or fn(st))

    class Run(DiagnosedRun):
        diagnostics = ("dormant", "grad_norms")

        def train(self, injected):
            return {"step": 4.0, "return": 0.5}, state

    row = Run().step(True)
    assert [name for name, _ in calls] == ["dormant", "grad_norms"] and all(st is state for _, st in calls)
    assert list(row) == ["step", "return", "dormant_share", "grad_norm/00", "grad_norm/01", "grad_norm_total"]
    assert row["dormant_share"] == pytest.approx(1 / 3)  # the first unit never fires
    assert row["grad_norm/00"] == pytest.approx(0.5 * math.sqrt(9)) and row["grad_norm/01"] == pytest.approx(1.0)
    tasks = Path(__file__).resolve().parents[1] / "tasks"
    assert not [p.name for p in tasks.rglob("*.py") if "DIAGNOSTICS[" in p.read_text()]
