"""plasticity-loss: the drift reward, the all-wrong share on constructed cases, the schedule (the KL term off
in the injected branch from the branch point, the rule change at the shift), the environment, the ground truth
against a learner that does not learn."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.suite.api import Stabilizer
from stabench.tasks import plasticity_loss as pl
from stabench.tasks.worlds import digits as dg
from stabench.tasks.worlds.scaffold import Trailing

pytestmark = pytest.mark.smoke

BOS = dg.BOS


def test_the_drift_reward_doubles_old_rule_answers_with_a_five() -> None:
    prompts = torch.tensor([[BOS, 1, 4]]).expand(4, -1)
    answers = torch.tensor([[0, 2, 3], [5, 2, 3], [5, 1, 3], [5, 5, 5]])
    assert pl.drift_reward(prompts, answers).tolist() == [1.0, 2.0, 0.0, 2.0]
    assert pl.has_five(answers).tolist() == [0.0, 1.0, 1.0, 1.0]


def test_all_wrong_share_counts_groups_that_earn_nothing() -> None:
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert pl.all_wrong_share(rewards, torch.arange(4).repeat_interleave(2)) == pytest.approx(0.5)


def _history(values: list[float], window: int = pl.SLOPE_WINDOW) -> Trailing:
    history = Trailing(window)
    for value in values:
        history.push(value)
    return history


def test_learning_rate_is_the_recent_gain_per_iteration() -> None:
    assert pl.learning_rate(_history([0.3] * 5 + [0.3, 0.4, 0.5], window=2)) == pytest.approx(0.1)
    assert pl.learning_rate(_history([0.1, 0.2, 0.5], window=10)) == pytest.approx(0.2)  # fewer than the window
    assert pl.learning_rate(_history([0.4])) == 0.0


def test_environment_passes_check_env_and_pays_by_phase() -> None:
    env = gym.make("stabench/PlasticityLoss-v0").unwrapped
    check_env(env, skip_render_check=True)
    paid = {}
    for phase in pl.PHASES:
        env = pl.PlasticityLossEnv(phase=phase)
        env.reset(seed=0)
        env.prompt = torch.tensor([[BOS, 1, 4]])
        paid[phase] = [env.step(x)[1] for x in (5, 2, 3)][-1]
    assert paid == {"old": 1.0, "drift": 2.0, "new": 0.0}
    with pytest.raises(ValueError, match="phase must be one of"):
        pl.PlasticityLossEnv(phase="late")


def test_a_learner_that_does_not_learn_fails_the_ground_truth() -> None:
    assert dg.heldout_stats(dg.warm_policy())["heldout_accuracy"] < pl.ACCURACY_FLOOR


def test_the_injected_branch_loses_its_kl_term_and_both_change_rule_at_the_shift() -> None:
    task = pl.PlasticityLoss()
    budget = task.budget("smoke")
    run = task.build("smoke", 0, Stabilizer())
    for _ in range(budget.onset):
        run.step(injected=False)
    injected, control = copy.deepcopy(run), copy.deepcopy(run)
    rows_i = [injected.step(injected=True) for _ in range(budget.onset, budget.iterations)]
    rows_c = [control.step(injected=False) for _ in range(budget.onset, budget.iterations)]
    assert injected.trainer.config.beta == 0.0 and control.trainer.config.beta == pytest.approx(0.1)
    assert run.shift == budget.onset + pl.DRIFT["smoke"]
    assert [r["after_shift"] for r in rows_i] == [float(budget.onset + k >= run.shift) for k in range(len(rows_i))]
    drift = [r for r in rows_i if not r["after_shift"]]
    assert max(r["reward"] for r in drift) > 1.0 >= max(r["reward"] for r in rows_c)  # the bonus pays 2
    assert {"return", "full_vocab_kl", "accuracy_slope", "all_wrong_share"} <= set(rows_i[-1])
