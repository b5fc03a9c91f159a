"""The contract between trainers, stabilizers and the harness, checked on the real trainers and registries.

- every trainer hands its `loss` hook the batch keys `suite.api.TRAINER_KEYS` promises, with `logp` and
  `entropy` carrying the graph in the policy-gradient trainers;
- `rollout` is a declared, guarded hook: the trainers of `ROLLOUT_TRAINERS` call it once per iteration and use
  what it returns, the others never (and a stabilizer that overrides it applies only where it is called);
- every trainer reports the loss schema: exactly the keys `TRAINER_LOSSES` names, each the mean over the
  iteration's updates, and the last update's terms as `extras["loss_terms"]`;
- a gradient set to None in `after_backward` means "no update" in every trainer, and the diagnostics still
  see the raw gradients;
- `applies_to` follows `needs`; the method matrix plans a trial or an identity for every (task, method);
  `collect` copies the baseline's rows for identities; scoring ranks over the common task set;
- packaging: one `stabench` package, environments registered lazily, trainers independent of tasks;
- the README's example stabilizer applies to every task and runs on every trainer.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TOY
from scipy import stats
from stabench.suite import registry, runner, skill, statistics
from stabench.suite.api import (
    BEHAVIOUR_POLICY,
    LOSS_SCHEMA,
    ROLLOUT_TRAINERS,
    TRAINER_CAPABILITIES,
    TRAINER_KEYS,
    TRAINER_LOSSES,
    StabenchError,
    Stabilizer,
    provided_keys,
)
from stabench.suite.registry import Guarded, PluginError
from stabench.suite.runner import ExperimentSpec
from stabench.suite.trial import TrialSpec, run_trial

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = f"{Path(__file__).parent / 'plugins' / 'contract.py'}:RecordAndSkip"
HOOKS = f"{Path(__file__).parent / 'plugins' / 'hooks.py'}:RecordHooks"
SPIKE_SKIP = f"{ROOT / 'examples' / 'my_stabilizer.py'}:SpikeSkip"


def first_task_of_each_trainer() -> dict[str, str]:
    """One real task per trainer (the first built-in that trains with it), run at the smoke tier: a new trainer's
    first task joins these tests by itself."""
    found: dict[str, str] = {}
    for name in registry.discover("task"):
        found.setdefault(registry.get_task(name).trainer, name)
    return found


TASK_OF_TRAINER = first_task_of_each_trainer()
POLICY_GRADIENT = ("ppo", "grpo", "token-ppo", "tool-ppo")
ITERATIONS = 3  # healthy iterations stepped per run (DQN's first iteration only fills its replay buffer)


def policy_of(trainer) -> torch.nn.Module:
    """The network the trainer's optimizer updates and `after_backward` edits."""
    return trainer.policy if hasattr(trainer, "policy") else trainer.model


def recorded_run(trainer_name: str, plugin: str) -> tuple:
    """The trainer's task built on the smoke tier under `plugin`, its trainer's `iterate` recording the
    TrainStates it returns (what the task's diagnostics read): (task, guarded stabilizer, run, states)."""
    task = registry.get_task(TASK_OF_TRAINER[trainer_name])
    torch.manual_seed(0)
    stabilizer = registry.make_stabilizer(plugin)
    run = task.build("smoke", 0, stabilizer)
    states = []
    iterate = run.trainer.iterate

    def recording_iterate(*args, **kwargs):
        state = iterate(*args, **kwargs)
        states.append(state)
        return state

    run.trainer.iterate = recording_iterate
    return task, stabilizer, run, states


@functools.cache
def contract_run(trainer_name: str) -> dict:
    """One smoke-tier run of the trainer's task under `RecordAndSkip`, stepped `ITERATIONS` healthy iterations.

    Returns the stabilizer's records, the TrainStates the trainer returned, and the policy's parameters after
    each iteration (and at build)."""
    task, stabilizer, run, states = recorded_run(trainer_name, CONTRACT)
    assert task.trainer == trainer_name
    snapshot = lambda: copy.deepcopy(policy_of(run.trainer).state_dict())  # noqa: E731
    params = [snapshot()]
    calls = []
    for _ in range(ITERATIONS):
        run.step(False)
        params.append(snapshot())
        calls.append(len(stabilizer.inner.loss_calls))
    return {"task": task, "stabilizer": stabilizer.inner, "states": states, "params": params, "calls": calls,
            "policy": policy_of(run.trainer)}


@pytest.mark.parametrize("trainer_name", list(TASK_OF_TRAINER))
def test_the_loss_hook_receives_every_key_of_the_trainer_schema(trainer_name: str) -> None:
    result = contract_run(trainer_name)
    required = TRAINER_KEYS[trainer_name] - result["task"].provides  # batch keys; task capabilities skipped
    calls = result["stabilizer"].loss_calls
    assert calls, "the loss hook was never called"
    for call in calls:
        missing = sorted(required - call["keys"])
        assert not missing, f"{trainer_name}: the loss hook's batch lacks {missing}"
        if trainer_name in POLICY_GRADIENT:
            assert {"logp", "entropy"} <= call["requires_grad"], f"{trainer_name}: {sorted(call['requires_grad'])}"
            assert "policy" in call["terms"]


@pytest.mark.parametrize("trainer_name", list(TASK_OF_TRAINER))
def test_a_none_gradient_means_no_update_in_every_trainer(trainer_name: str) -> None:
    result = contract_run(trainer_name)
    stab, params, calls = result["stabilizer"], result["params"], result["calls"]
    # the hook ran on the iterations compared (DQN starts updating once its buffer holds enough)
    assert calls[-1] > calls[0] and stab.skipped == calls[-1]
    first, last = params[1], params[-1]
    assert first.keys() == last.keys()
    changed = [k for k in first if not torch.equal(first[k], last[k])]
    assert not changed, f"{trainer_name}: parameters moved although every gradient was None: {changed[:5]}"


@pytest.mark.parametrize("trainer_name", list(TASK_OF_TRAINER))
def test_diagnostics_see_the_raw_gradients(trainer_name: str) -> None:
    result = contract_run(trainer_name)
    state = result["states"][-1]
    assert state.grads, f"{trainer_name}: TrainState.grads is empty"
    assert any(float(g.abs().sum()) > 0 for g in state.grads.values())  # raw, although the hook zeroed them
    names = {n for n, _ in result["policy"].named_parameters()}
    assert set(state.grads) <= names
    assert all(p.grad is None for p in result["policy"].parameters())  # the hook's edit did take effect
    assert result["stabilizer"].nonzero_grads_seen > 0


# ---- the rollout hook and the loss report ---------------------------------------------------------------------
@functools.cache
def hooks_run(trainer_name: str) -> dict:
    """One smoke-tier run of the trainer's task under `RecordHooks`, stepped `ITERATIONS` healthy iterations: the
    hook's records, the TrainStates, and how many `loss` calls each iteration made."""
    task, stabilizer, run, states = recorded_run(trainer_name, HOOKS)
    updates = []
    for _ in range(ITERATIONS):
        before = len(stabilizer.inner.loss_terms)
        run.step(False)
        updates.append(stabilizer.inner.loss_terms[before:])
    return {"task": task, "stabilizer": stabilizer, "states": states, "updates": updates}


@pytest.mark.parametrize("trainer_name", list(TASK_OF_TRAINER))
def test_the_rollout_hook_is_called_once_per_iteration_where_declared_and_its_batch_is_used(trainer_name: str):
    result = hooks_run(trainer_name)
    hooks, task = result["stabilizer"], result["task"]
    calls = hooks.inner.rollout_calls
    if trainer_name not in ROLLOUT_TRAINERS:
        assert calls == [], f"{trainer_name} calls `rollout` but is not in ROLLOUT_TRAINERS"
        assert not hooks.applies_to(task)  # a stabilizer whose rollout would never run does not apply there
        return
    assert len(calls) == ITERATIONS and hooks.applies_to(task)
    for call in calls:
        assert {"advantages", "returns", "values", "rewards", "dones", "obs", "actions"} <= call["keys"]
        assert call["info"] == {"num_steps", "num_envs", "gamma", "gae_lambda", "next_value", "next_done"}
    for state in result["states"]:  # the batch the trainer went on with is the one the hook returned
        assert torch.equal(state.batch["advantages"], torch.full((calls[0]["rows"],), 0.25))


def test_every_builtin_rollout_hook_is_on_a_trainer_that_calls_it():
    tasks = all_tasks()
    for name in registry.discover("stabilizer"):
        cls = registry.resolve_class("stabilizer", name)
        if cls.rollout is not Stabilizer.rollout:
            assert {t.trainer for t in tasks if cls().applies_to(t)} <= ROLLOUT_TRAINERS, name


class _Rollout(Stabilizer):
    name = "bad-rollout"

    def __init__(self, rewrite) -> None:
        self.rewrite = rewrite

    def rollout(self, batch, info):
        return self.rewrite(batch)


@pytest.mark.parametrize(
    ("rewrite", "message"),
    [
        (lambda b: [b["advantages"]], "bad-rollout.rollout returned list, expected a dict of tensors"),
        (lambda b: {"advantages": b["advantages"]}, "bad-rollout.rollout dropped the batch keys returns"),
        (lambda b: {**b, "returns": b["returns"][:2]}, "bad-rollout.rollout['returns'] returned shape (2,)"),
        (lambda b: {**b, "advantages": b["advantages"] / 0}, "bad-rollout.rollout['advantages'] produced non-finite"),
        (lambda b: 1 / 0, "bad-rollout.rollout raised ZeroDivisionError"),
    ],
)
def test_the_guard_checks_what_rollout_returns(rewrite, message):
    batch = {"advantages": torch.tensor([1.0, -1.0, 0.5]), "returns": torch.tensor([0.0, 1.0, 2.0])}
    with pytest.raises(PluginError, match=re.escape(message)):
        Guarded(_Rollout(rewrite)).rollout(batch, {})
    assert Guarded(_Rollout(lambda b: b)).rollout(batch, {}).keys() == batch.keys()


def test_the_loss_schema_names_every_trainers_keys():
    assert set(TRAINER_LOSSES) == set(TRAINER_KEYS)
    for trainer, keys in TRAINER_LOSSES.items():
        assert keys <= set(LOSS_SCHEMA), trainer
    shared = set.intersection(*(set(TRAINER_LOSSES[t]) for t in POLICY_GRADIENT))
    assert {"loss", "policy_loss", "entropy_loss", "approx_kl", "clip_frac", "ratio_p99", "ratio_max",
            "entropy"} <= shared


# the pre-hook term behind each reported loss, and its coefficient in the terms (1: the term is the loss itself)
TERM_OF_LOSS = {
    "ppo": {"policy_loss": ("policy", 1.0), "value_loss": ("value", 0.5)},
    "grpo": {"policy_loss": ("policy", 1.0)},
    "token-ppo": {"policy_loss": ("policy", 1.0)},
    "tool-ppo": {"policy_loss": ("policy", 1.0)},
    "dqn": {"td_loss": ("td", 1.0)},
}


@pytest.mark.parametrize("trainer_name", list(TASK_OF_TRAINER))
def test_every_trainer_reports_the_loss_schema_as_means_over_its_updates(trainer_name: str):
    result = hooks_run(trainer_name)
    assert len(result["states"]) == ITERATIONS
    for state, updates in zip(result["states"], result["updates"]):
        assert set(state.losses) == TRAINER_LOSSES[trainer_name], sorted(state.losses)
        assert all(isinstance(v, float) for v in state.losses.values())
        if not updates:  # DQN's first iteration only fills its replay buffer
            assert math.isnan(state.losses["loss"]) and state.extras["loss_terms"] == {}
            continue
        assert state.extras["loss_terms"] == updates[-1]  # the last update's terms, as the hook returned them
        totals = [sum(terms.values()) for terms in updates]
        assert state.losses["loss"] == pytest.approx(np.mean(totals), rel=1e-5, abs=1e-7)
        for key, (term, coef) in TERM_OF_LOSS[trainer_name].items():
            mean = np.mean([terms[term] for terms in updates]) / coef
            assert state.losses[key] == pytest.approx(mean, rel=1e-5, abs=1e-7), key
        if "ratio_p99" in state.losses:
            assert 0.0 <= state.losses["clip_frac"] <= 1.0
            assert state.losses["ratio_p99"] <= state.losses["ratio_max"] + 1e-6


# ---- where a stabilizer applies -------------------------------------------------------------------------------
class NeedsRef(Stabilizer):
    name = "needs-ref"
    needs = frozenset({"ref_logp"})


class NeedsEnsemble(Stabilizer):
    name = "needs-ensemble"
    needs = frozenset({"reward_ensemble"})


def all_tasks():
    return [registry.get_task(n) for n in registry.names("task")]


def test_applies_to_follows_needs() -> None:
    tasks = all_tasks()
    trainers = {t.trainer for t in tasks}
    assert {"grpo", "ppo"} <= trainers
    for task in tasks:
        assert NeedsRef().applies_to(task) == (task.trainer == "grpo"), task.id
        assert NeedsEnsemble().applies_to(task) == (task.id == "reward-hacking"), task.id
        assert registry.make_stabilizer("markovian-chunks").applies_to(task) == (task.id == "length-explosion")
        assert Stabilizer().applies_to(task)  # the baseline needs nothing
        assert provided_keys(task) == (TRAINER_KEYS[task.trainer] | task.provides
                                       | TRAINER_CAPABILITIES.get(task.trainer, frozenset()))


IMPORTANCE = ("token-tis", "seq-tis", "token-mis", "seq-mis", "geo-mis", "turn-is")


def test_importance_corrections_act_only_where_something_else_samples() -> None:
    """Where the learner samples, q = pi_old and the corrections compute the trainer's own term: they do not act."""
    for task in all_tasks():
        elsewhere = BEHAVIOUR_POLICY in provided_keys(task)
        assert elsewhere == (task.trainer == "tool-ppo" or BEHAVIOUR_POLICY in task.provides), task.id
        for name in IMPORTANCE[:5]:
            assert registry.make_stabilizer(name).applies_to(task) == elsewhere, (name, task.id)
    wide = {t.id for t in all_tasks() if BEHAVIOUR_POLICY in provided_keys(t)}
    assert {"inference-mismatch", "moe-routing", "parallel-staleness", "rare-tool-states"} <= wide
    assert not {"entropy-collapse", "kl-estimator-bias", "dead-layers", "missing-critic"} & wide


class SamplerWitness(Stabilizer):
    """Records, for every update, whether the batch's actions were sampled by the learner at pi_old."""

    def __init__(self) -> None:
        self.same: list[bool] = []

    def loss(self, terms, batch):
        self.same.append(bool(torch.equal(batch["behaviour_logp"], batch["old_logp"])))
        return terms


def witnessed(name: str) -> tuple[list[bool], int]:
    """A smoke run of the task (healthy phase, then the injected branch) seen by a `SamplerWitness`: its record,
    one entry per update, and the onset."""
    torch.set_num_threads(1)
    task = registry.get_task(name)
    budget = task.budget("smoke")
    witness = SamplerWitness()
    run = task.build("smoke", 0, witness)
    for it in range(budget.iterations):
        run.step(it >= budget.onset)
    return witness.same, budget.onset


@pytest.mark.parametrize("name", [n for n in registry.names("task")
                                  if "behaviour_logp" in TRAINER_KEYS[registry.get_task(n).trainer]
                                  and BEHAVIOUR_POLICY not in provided_keys(registry.get_task(n))])
def test_a_task_that_does_not_declare_another_sampler_has_none(name: str) -> None:
    """The declaration the corrections' applicability rests on is true: every update of a smoke run, healthy
    phase and injected branch, sees behaviour_logp equal to old_logp bit for bit."""
    same, _ = witnessed(name)
    assert same and all(same), name


def test_a_declared_sampler_differs_from_the_learner() -> None:
    """And the other way: on inference-mismatch the injected sampler's log-probs differ from pi_old after onset."""
    same, onset = witnessed("inference-mismatch")
    assert all(same[:onset]) and not any(same[onset:])


def test_every_builtin_stabilizer_applies_somewhere() -> None:
    tasks = all_tasks()
    for name in registry.discover("stabilizer"):
        stab = registry.make_stabilizer(name)
        assert any(stab.applies_to(t) for t in tasks), name
    # `trainers` narrows by hand: the network rebuild only where the PPO tasks' actor-critic is
    fix = registry.make_stabilizer("multiskip-residual")
    assert {t.trainer for t in tasks if fix.applies_to(t)} == {"ppo"}


# ---- the method matrix ----------------------------------------------------------------------------------------
def test_the_matrix_plans_a_trial_or_an_identity_for_every_task_and_method() -> None:
    tasks = ("kl-estimator-bias", "parallel-staleness")
    trials, identities = ExperimentSpec(tier="smoke", tasks=tasks, matrix=True, seeds=1).plan()
    everything = set(registry.names("stabilizer"))
    for task in tasks:
        ran = {t.method for t in trials if t.task == task}
        idle = {m for t, cell, m in identities if t == task}
        assert ran | idle == everything and not ran & idle, task
        assert "baseline" in ran
        assert all(t.seed == 0 and t.tier == "smoke" for t in trials if t.task == task)
        obj = registry.get_task(task)
        assert all(registry.make_stabilizer(m).applies_to(obj) for m in ran)
        assert not any(registry.make_stabilizer(m).applies_to(obj) for m in idle)
    assert ("kl-estimator-bias", "", "vtrace") in identities
    assert ("parallel-staleness", "", "kl-max") in identities
    assert not any(t.task == "kl-estimator-bias" and t.method == "vtrace" for t in trials)
    assert any(t.task == "parallel-staleness" and t.method == "vtrace" for t in trials)
    with pytest.raises(StabenchError, match="matrix"):
        ExperimentSpec(tier="smoke", tasks=tasks, matrix=True, methods=("baseline",)).plan()
    with pytest.raises(StabenchError, match="does not apply to task"):
        ExperimentSpec(tier="smoke", tasks=("parallel-staleness",), methods=("baseline", "kl-max")).plan()


class FakeCheckpoint:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @contextmanager
    def as_directory(self):
        yield str(self.folder)


class FakeResult:
    """What `collect` reads of a Ray Tune result: the trial's config, its checkpoint, metrics and error."""

    def __init__(self, spec: TrialSpec, folder: Path) -> None:
        self.config = {"trial": {**asdict(spec), "knobs": list(spec.knobs)}}
        self.checkpoint = FakeCheckpoint(folder)
        self.metrics = {"seconds": 0.5}
        self.error = None


def test_collect_copies_the_baselines_rows_for_an_identity(tmp_path: Path) -> None:
    task_ref = f"{TOY}:ToyTask"
    expected = [TrialSpec(task_ref, "baseline", seed, "smoke", detectors=()) for seed in (0, 1)]
    results = []
    for spec in expected:
        folder = tmp_path / f"seed{spec.seed}"
        folder.mkdir()
        run_trial(spec).to_parquet(folder / "rows.parquet", index=False)
        results.append(FakeResult(spec, folder))
    table, trials = runner.collect(results, expected, {}, [(task_ref, "", "grad-clip")])
    base = table[table["method"] == "baseline"].reset_index(drop=True)
    copies = table[table["method"] == "grad-clip"].reset_index(drop=True)
    assert len(base) == len(copies) > 0 and set(table["method"]) == {"baseline", "grad-clip"}
    assert base["acts"].eq(True).all() and copies["acts"].eq(False).all()
    assert copies["method_ref"].eq("grad-clip").all()
    assert copies["role"].eq(registry.get_task(task_ref).role("grad-clip")).all()
    own = ["method", "method_ref", "role", "acts"]
    pd.testing.assert_frame_equal(base.drop(columns=own), copies.drop(columns=own))
    assert sorted(trials.loc[trials["status"] == "identity", "seed"]) == [0, 1]
    assert set(trials.loc[trials["status"] == "identity", "method"]) == {"grad-clip"}
    assert trials.loc[trials["method"] == "baseline", "status"].eq("ok").all() and len(trials) == 4


# ---- scoring over the common task set -------------------------------------------------------------------------
def test_across_tasks_ranks_over_the_common_tasks_and_lists_where_a_method_acts() -> None:
    rng = np.random.default_rng(0)
    rows = []

    def add(task: str, method: str, acts: bool, values) -> None:
        rows.extend({"task": task, "method": method, "seed": s, "variant": v, "acts": acts, "normalized_return": x}
                    for s, x in enumerate(values) for v in ("injected", "control"))

    base = {t: rng.normal(0.5, 0.2, 4) for t in ("a", "b", "c")}
    for t, values in base.items():
        add(t, "baseline", True, values)
    for t in ("a", "b"):
        add(t, "full", True, rng.normal(0.8, 0.1, 4))
        add(t, "partial", True, rng.normal(0.9, 0.1, 4))
    add("c", "full", False, base["c"])  # does not act on c: the baseline's runs, copied
    per_run = pd.DataFrame(rows)
    assert statistics.common_tasks(per_run) == ["a", "b", "c"]
    agg = {r["method"]: r for r in statistics.across_tasks(per_run)}
    full, partial = agg["full"], agg["partial"]
    assert full["ranked"] and full["n_tasks"] == 3 and full["acts_on"] == ["a", "b"]
    assert not partial["ranked"] and partial["n_tasks"] == 2 and partial["acts_on"] == ["a", "b"]
    assert agg["baseline"]["ranked"] and agg["baseline"]["acts_on"] == ["a", "b", "c"]
    injected = per_run[(per_run["variant"] == "injected") & (per_run["method"] == "full")]
    assert full["iqm"] == pytest.approx(float(stats.trim_mean(injected["normalized_return"], 0.25)))
    assert math.isfinite(full["probability_of_improvement"])


def test_detector_runs_leave_out_the_copies_of_the_baseline() -> None:
    task_ref = f"{TOY}:ToyTask"
    base = pd.concat([run_trial(TrialSpec(task_ref, "baseline", s, "smoke")) for s in (0, 1)], ignore_index=True)
    fix = pd.concat([run_trial(TrialSpec(task_ref, f"{TOY}:ToyFix", s, "smoke")) for s in (0, 1)],
                    ignore_index=True)
    copies = base.assign(method="grad-clip", method_ref="grad-clip", role="other", acts=False)
    table = pd.concat([base.assign(acts=True), fix.assign(acts=True), copies], ignore_index=True)
    counts = skill.detector_runs(table)["method"].value_counts().to_dict()
    assert set(counts) == {"baseline", "toy-fix"} and counts["baseline"] == counts["toy-fix"] > 0
    n_detectors = skill.detector_runs(table).query("method == 'baseline'")["detector"].nunique()
    assert counts["baseline"] == n_detectors * 2 * 2  # detectors x seeds x variants
    # the filter is what removes them: without the `acts` column the copies count as runs
    assert skill.detector_runs(table.drop(columns="acts"))["method"].value_counts()["grad-clip"] == counts["baseline"]


# ---- packaging --------------------------------------------------------------------------------------------------
def test_one_installed_package_with_lazily_registered_environments(tmp_path: Path) -> None:
    code = (
        "import importlib.util, sys\n"
        "import gymnasium as gym\n"
        "import stabench\n"
        "assert 'stabench.tasks.worlds.grids' not in sys.modules, 'a task module was imported eagerly'\n"
        "env = gym.make('stabench/EmptyFlat-5x5-v0')\n"
        "obs, _ = env.reset(seed=0)\n"
        "assert obs.shape == (147,), obs.shape\n"
        "for name in ('suite', 'tasks', 'baselines'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "print('ok', stabench.__version__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok 0.3.0"


def test_the_grid_tasks_declare_the_environments_their_runs_build() -> None:
    """`environments` is a literal read from the source: it must agree with the constants the runs use."""
    import gymnasium as gym
    from stabench.tasks import policy_churn, primacy_bias

    for module, task_id in ((policy_churn, "policy-churn"), (primacy_bias, "primacy-bias")):
        declared = registry.resolve_class("task", task_id).environments
        entry, kwargs = declared[module.ENV_ID]
        assert kwargs == {"size": module.SIZE, "max_steps": module.MAX_STEPS}, task_id
        spec = gym.spec(module.ENV_ID)
        assert spec.entry_point == f"{module.__name__}:{entry}" and spec.kwargs == kwargs
        env = gym.make(module.ENV_ID)
        obs, _ = env.reset(seed=0)
        assert obs.shape == (module.OBS_DIM,)
        env.close()


def test_trainers_do_not_import_tasks() -> None:
    files = sorted((ROOT / "baselines").rglob("*.py"))
    assert len(files) > 5
    for path in files:
        text = path.read_text()
        for needle in ("stabench.tasks", "from tasks", "import tasks"):
            assert needle not in text, f"{path.relative_to(ROOT)} mentions {needle!r}"


# ---- the README's example stabilizer --------------------------------------------------------------------------
def test_the_readme_example_applies_to_every_task() -> None:
    stab = registry.make_stabilizer(SPIKE_SKIP)
    assert stab.name == "spike-skip" and registry.method_name(SPIKE_SKIP) == "spike-skip"
    assert all(stab.applies_to(t) for t in all_tasks())


@pytest.mark.parametrize("task_name", list(TASK_OF_TRAINER.values()))
def test_the_readme_example_runs_on_every_trainer(task_name: str) -> None:
    table = run_trial(TrialSpec(task_name, SPIKE_SKIP, 0, "smoke", detectors=()))
    budget = registry.get_task(task_name).budget("smoke")
    assert (table["status"] == "ok").all(), table["error"].unique()
    assert set(table["method"]) == {"spike-skip"} and set(table["variant"]) == {"injected", "control"}
    assert len(table) == 2 * budget.iterations
