"""calibration-collapse: the guessing world, the exact calibration measures, the confidence-gap diagnostic and
the Brier reward on constructed cases, the environment, the ground truth against a learner that does not learn,
branching."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.rewards import BrierReward, brier_reward, group_normalized
from stabench.suite.api import Stabilizer
from stabench.suite.diagnostics import confidence_gap
from stabench.tasks import calibration_collapse as cc

pytestmark = pytest.mark.smoke

BOS = cc.N_ACTIONS


def test_hidden_digits_are_uniform_over_the_allowed_ones() -> None:
    prompts = torch.tensor([[BOS, 1, 4]]).expand(3, -1)  # allowed: 0, 2, 3
    assert cc.hidden_digits(prompts, np.array([0.0, 0.34, 0.99])).tolist() == [0, 2, 3]
    same = torch.tensor([[BOS, 2, 2]]).expand(4, -1)  # allowed: 0, 1, 3, 4
    assert cc.hidden_digits(same, np.array([0.0, 0.25, 0.5, 0.75])).tolist() == [0, 1, 3, 4]


def test_a_guess_pays_only_valid_answers_ending_on_the_hidden_digit() -> None:
    prompts = torch.tensor([[BOS, 1, 4]]).expand(4, -1)
    answers = torch.tensor([[0, 2, 3, 5], [0, 3, 2, 5], [5, 2, 3, 0], [1, 2, 3, 5]])
    # hidden digit 3 for all: valid and ending 3; valid ending 2; holds a 5; holds a prompt digit
    assert cc.guess_reward(prompts, answers, np.full(4, 0.9)).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert cc.stated_confidence(answers).tolist() == pytest.approx([1.0, 1.0, 0.0, 1.0])


def test_acceptance_in_the_guessing_world_is_one_in_the_allowed_count() -> None:
    guess, new = cc.acceptance("guess"), cc.acceptance("new")
    for i, (a, b) in enumerate(cc.HELDOUT_PROMPTS[:, 1:].tolist()):
        n_allowed = len({0, 1, 2, 3, 4} - {a, b})
        assert torch.allclose(guess[i], new[i] / n_allowed)
    with pytest.raises(ValueError, match="world must be one of"):
        cc.acceptance("hard")


def test_calibration_measures_are_zero_for_a_confidence_equal_to_the_chance_of_being_right() -> None:
    """A constructed joint: every answer equally likely, the confidence on the level nearest p(x)."""
    accept = cc.acceptance("new")  # 0 or 1: levels 0 and 5 state it exactly
    joint = torch.zeros(len(accept), accept.shape[1], cc.N_ACTIONS, dtype=torch.float64)
    joint[..., 0] = (1 - accept) / accept.shape[1]
    joint[..., 5] = accept / accept.shape[1]
    stats = cc.calibration_stats_of(joint, "new")
    assert stats["heldout_brier"] == pytest.approx(0.0) and stats["heldout_ece"] == pytest.approx(0.0)
    overconfident = torch.zeros_like(joint)
    overconfident[..., 5] = 1 / accept.shape[1]  # always certain
    stats = cc.calibration_stats_of(overconfident, "new")
    wrong = float((1 - accept).mean())  # each wrong answer costs (1 - 0)^2
    assert stats["heldout_brier"] == pytest.approx(wrong) and stats["heldout_confidence"] == pytest.approx(1.0)


def test_confidence_gap_reads_overconfidence_and_whether_confidence_tracks_rewards() -> None:
    out = confidence_gap(torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert out == pytest.approx({"confidence_gap": 0.75, "confidence_reward_cov": 0.0})
    out = confidence_gap(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert out == pytest.approx({"confidence_gap": 0.0, "confidence_reward_cov": 0.25})


def test_brier_reward_pays_an_honest_guess_and_reduces_to_grpo_when_confidence_is_the_outcome() -> None:
    assert brier_reward(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.2])).tolist() == pytest.approx(
        [1.0, -1.0, -0.04]
    )
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    group = torch.arange(2).repeat_interleave(4)
    r = rewards.view(2, 4)
    grpo = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
    assert torch.allclose(group_normalized(rewards, group), grpo)
    batch = {"rewards": rewards, "confidence": rewards, "group": group, "mask": torch.ones(8, 4)}
    assert torch.allclose(BrierReward().advantages(torch.zeros(8, 4), batch), grpo[:, None].expand(8, 4))
    batch["confidence"] = torch.full((8,), 0.5)  # an undecided confidence changes nothing within a 0/1 group
    assert torch.allclose(BrierReward().advantages(torch.zeros(8, 4), batch)[:, 0], grpo, atol=1e-3)


def test_environment_passes_check_env_and_pays_by_world() -> None:
    env = gym.make("stabench/CalibrationCollapse-v0").unwrapped
    check_env(env, skip_render_check=True)
    env = cc.CalibrationCollapseEnv(injected=False)
    env.reset(seed=0)
    env.prompt = torch.tensor([[BOS, 1, 4]])
    assert [env.step(x)[1] for x in (0, 2, 3, 5)][-1] == 1.0  # valid digits, any confidence
    old = cc.CalibrationCollapseEnv(after_onset=False)
    old.reset(seed=0)
    old.prompt = torch.tensor([[BOS, 1, 4]])
    assert [old.step(x)[1] for x in (5, 2, 3, 0)][-1] == 1.0  # a 5 is fine under the old rule


def test_a_learner_that_does_not_learn_fails_the_ground_truth() -> None:
    assert cc.calibration_stats(cc.warm_policy(), "guess")["heldout_brier"] > cc.BRIER_CEILING


def test_branches_differ_in_the_world_and_the_task_provides_confidence() -> None:
    task = cc.CalibrationCollapse()
    assert BrierReward().applies_to(task)
    run = task.build("smoke", 0, Stabilizer())
    for _ in range(task.budget("smoke").onset):
        run.step(injected=False)
    row_i = copy.deepcopy(run).step(injected=True)
    row_c = copy.deepcopy(run).step(injected=False)
    assert row_i["heldout_accuracy"] < row_c["heldout_accuracy"] / 2  # a guess of 1 in 3 or 4
    assert row_i["confidence_gap"] > row_c["confidence_gap"]
    assert row_i["return"] == pytest.approx(1 - row_i["heldout_brier"])
