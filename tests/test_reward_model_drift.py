"""reward-model-drift: the RM's pieces on constructed cases (ridge fit, pair accuracy), the aliasing of the warm
projection (it cannot tell an answer with a 5 from one without), the feature source per branch and method, the
environment, the ground truth against a learner that does not learn, and where `r2m-features` applies."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.reward_models import R2MFeatures
from stabench.suite.api import Stabilizer
from stabench.tasks import reward_model_drift as rmd
from stabench.tasks.plasticity_loss import PlasticityLoss
from stabench.tasks.worlds.digits import ALL_ANSWERS, TRAIN_PROMPTS

pytestmark = pytest.mark.smoke

BOS = rmd.N_ACTIONS


def test_ridge_fit_recovers_a_linear_target() -> None:
    x = rmd.with_constant(torch.tensor(np.random.default_rng(0).normal(size=(50, 3))))
    w = torch.tensor([1.0, -2.0, 0.5, 0.25], dtype=torch.float64)
    assert torch.allclose(rmd.ridge_fit(x, x @ w), w, atol=1e-3)


def test_pair_accuracy_counts_pairs_of_one_group_with_different_gold() -> None:
    gold = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    pred = torch.tensor([0.9, 0.1, 0.95, 0.2, 0.5, 0.4], dtype=torch.float64)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    # group 0: (0 > 1) right, (0 > 2) wrong; group 1: (3 > 4) wrong, (5 > 4) wrong
    assert rmd.pair_accuracy(pred, gold, group) == pytest.approx(0.25)
    assert np.isnan(rmd.pair_accuracy(pred, torch.ones(6, dtype=torch.float64), group))


def test_the_warm_projection_aliases_answers_with_and_without_a_five() -> None:
    run = rmd.RewardModelDrift().build("smoke", 0, Stabilizer())
    prompts = TRAIN_PROMPTS.repeat_interleave(len(ALL_ANSWERS), 0)
    answers = ALL_ANSWERS.repeat(len(TRAIN_PROMPTS), 1)
    five = (answers == 5).any(1).double()
    base_rate = max(float(five.mean()), 1 - float(five.mean()))

    def linear_accuracy(x: torch.Tensor) -> float:
        return float(((x @ rmd.ridge_fit(x, five) > 0.5).double() == five).double().mean())

    warm = run.feature_map("warm")(prompts, answers)
    full = run.feature_map("full")(prompts, answers)
    assert warm.shape[1] == rmd.RM_DIM + 1 and full.shape[1] == 3 * 32 + 1
    assert linear_accuracy(warm) < base_rate + 0.05  # nothing of "holds a 5" survives the projection
    assert linear_accuracy(full) > 0.9


def test_feature_source_by_branch_and_method() -> None:
    task = rmd.RewardModelDrift()
    budget = task.budget("smoke")
    run = task.build("smoke", 0, Stabilizer())
    assert run.source(injected=True) == "warm" == run.source(injected=False)  # before onset: one run
    for _ in range(budget.onset):
        run.step(injected=False)
    assert run.source(injected=True) == "warm" and run.source(injected=False) == "full"
    fixed = task.build("smoke", 0, R2MFeatures())
    assert fixed.source(injected=True) == "policy" == fixed.source(injected=False)
    x = fixed.feature_map("policy")(TRAIN_PROMPTS[:2], ALL_ANSWERS[:2])
    assert x.shape == (2, rmd.RM_DIM + 3 * 32 + 1)
    injected = copy.deepcopy(run)
    rows = [injected.step(injected=True) for _ in range(budget.onset, budget.iterations)]
    assert {"return", "rm_accuracy", "rm_gold_gap", "rm_pair_accuracy", "heldout_accuracy"} <= set(rows[-1])
    assert all(0.0 <= r["rm_accuracy"] <= 1.0 for r in rows)


def test_the_fix_applies_only_where_the_task_provides_rm_features() -> None:
    assert R2MFeatures().applies_to(rmd.RewardModelDrift())
    assert not R2MFeatures().applies_to(PlasticityLoss())


def test_environment_passes_check_env_and_pays_the_rule() -> None:
    env = gym.make("stabench/RewardModelDrift-v0").unwrapped
    check_env(env, skip_render_check=True)
    paid = {}
    for after in (False, True):
        env = rmd.RewardModelDriftEnv(after_onset=after)
        env.reset(seed=0)
        env.prompt = torch.tensor([[BOS, 1, 4]])
        paid[after] = [env.step(x)[1] for x in (5, 2, 3)][-1]
    assert paid == {False: 1.0, True: 0.0}


def test_a_learner_that_does_not_learn_fails_the_ground_truth() -> None:
    assert rmd.heldout_stats(rmd.warm_policy())["heldout_accuracy"] < rmd.ACCURACY_FLOOR
