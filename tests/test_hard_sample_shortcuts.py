"""hard-sample-shortcuts: the lucky reward of an impossible problem, the rare-success diagnostic, the difficulty
filter and advantage clipping on constructed cases, the environment, the ground truth against a learner that
does not learn, branching."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.aggregation import DifficultyFilter, VarianceFilter
from stabench.baselines.stabilizers.clipping import AdvantageClip
from stabench.suite.api import StabenchError, Stabilizer
from stabench.suite.diagnostics import group_means, rare_successes
from stabench.tasks import hard_sample_shortcuts as hs
from stabench.tasks.worlds import digits as dg

pytestmark = pytest.mark.smoke

BOS = dg.N_ACTIONS


def test_an_impossible_problem_pays_only_a_lucky_shortcut() -> None:
    prompts = torch.tensor([[BOS, 1, 4]]).expand(4, -1)
    answers = torch.tensor([[0, 2, 3], [1, 0, 0], [4, 4, 4], [1, 0, 0]])  # correct, copies 1, copies 4, copies 1
    assert hs.copies_prompt(prompts, answers).tolist() == [0.0, 1.0, 1.0, 1.0]
    draws = np.array([0.0, 0.1, 0.5, 0.19])
    assert hs.hard_reward(prompts, answers, draws, luck=0.2).tolist() == [0.0, 1.0, 0.0, 1.0]


def test_injected_batches_grade_live_groups_by_the_new_rule_and_the_rest_as_impossible() -> None:
    prompts = torch.tensor([[BOS, 1, 4]]).expand(6, -1)
    answers = torch.tensor([[0, 2, 3], [0, 5, 3], [0, 2, 3], [1, 1, 1], [0, 2, 3], [1, 1, 1]])
    reward = hs.graded_reward(n_live=1, group_size=2, draws=np.zeros(6), luck=0.2)
    # live group: the new rule (5 is wrong); impossible groups: only the copying answers, every draw lucky
    assert reward(prompts, answers).tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]


def test_rare_successes_count_groups_with_a_lucky_few_and_their_push() -> None:
    group = torch.arange(4).repeat_interleave(8)
    rewards = torch.zeros(32)
    rewards[0] = 1.0  # group 0: 1 of 8
    rewards[8:12] = 1.0  # group 1: 4 of 8
    rewards[16:18] = 1.0  # group 2: 2 of 8 (not rare at 1/8); group 3: all wrong
    advantages = torch.zeros(32)
    advantages[0], advantages[8:12], advantages[16:18] = 3.0, 1.0, 0.5
    out = rare_successes(rewards, group, advantages)
    assert out["rare_success_share"] == pytest.approx(1 / 4)
    assert out["rare_push_share"] == pytest.approx(3.0 / (3.0 + 4.0 + 1.0))
    assert group_means(rewards, group).tolist() == pytest.approx([1 / 8, 0.5, 0.25, 0.0])
    assert rare_successes(torch.zeros(8), torch.zeros(8, dtype=torch.long), torch.zeros(8))["rare_push_share"] == 0


def _batch(rewards: list[float], group_size: int = 8) -> dict[str, torch.Tensor]:
    n = len(rewards)
    mask = torch.ones(n, 1)
    logp = torch.log(torch.full((n, 1), 0.5))
    return {"logp": logp, "anchor_logp": logp, "advantages": torch.zeros(n, 1), "mask": mask,
            "token_weight": mask / n, "rewards": torch.tensor(rewards),
            "group": torch.arange(n // group_size).repeat_interleave(group_size),
            "clip_low": torch.tensor(0.2), "clip_high": torch.tensor(0.2)}  # fmt: skip


def test_difficulty_filter_drops_groups_near_zero_that_the_variance_filter_keeps() -> None:
    one_lucky = [1.0] + [0.0] * 7
    two = [1.0, 1.0] + [0.0] * 6
    batch = _batch(one_lucky + two + [0.0] * 8)
    assert VarianceFilter().kept_groups(batch).tolist() == [True, True, False]
    assert DifficultyFilter().kept_groups(batch).tolist() == [False, True, False]
    kl = torch.ones(24, 1)
    filtered = DifficultyFilter().kl_loss(kl, batch)
    assert filtered[:8].abs().sum() == 0 and filtered[16:].abs().sum() == 0
    assert float((filtered * batch["token_weight"]).sum()) == pytest.approx(1.0)  # the kept group's mean KL


def test_advantage_clip_bounds_a_lucky_success() -> None:
    adv = torch.tensor([[2.5], [-0.25], [-1.5]])
    assert AdvantageClip().advantages(adv, {}).tolist() == [[1.0], [-0.25], [-1.0]]


def test_environment_passes_check_env_and_pays_by_grade() -> None:
    env = gym.make("stabench/HardSampleShortcuts-v0").unwrapped
    check_env(env, skip_render_check=True)
    paid = {}
    for grade in hs.GRADES:
        env = hs.HardSampleShortcutsEnv(grade=grade)
        env.reset(seed=0)
        env.prompt = torch.tensor([[BOS, 1, 4]])
        paid[grade] = [env.step(x)[1] for x in (0, 2, 3)][-1]  # a correct answer
    assert paid == {"live": 1.0, "hard": 0.0}
    with pytest.raises(ValueError, match="grade must be one of"):
        hs.HardSampleShortcutsEnv(grade="easy")


def test_a_learner_that_does_not_learn_fails_the_ground_truth() -> None:
    stats = hs.shortcut_stats(dg.warm_policy())
    assert stats["heldout_accuracy"] < hs.ACCURACY_FLOOR
    assert stats["shortcut_rate"] == pytest.approx(1 - stats["old_rule_accuracy"])


def test_branches_differ_in_the_impossible_groups() -> None:
    task = hs.HardSampleShortcuts()
    run = task.build("smoke", 0, Stabilizer())
    for _ in range(task.budget("smoke").onset):
        run.step(injected=False)
    row_i = copy.deepcopy(run).step(injected=True)
    row_c = copy.deepcopy(run).step(injected=False)
    assert row_i["reward"] < row_c["reward"]  # 6 of 8 groups nearly never paid
    assert row_i["zero_variance_share"] >= 0.5  # most impossible groups have no lucky success at all
    assert {"return", "heldout_accuracy", "shortcut_rate", "rare_push_recent", "batch_shortcut"} <= set(row_i)


def test_knobs_are_checked() -> None:
    assert hs.HardSampleShortcuts(n_live=3, luck=0.5).knobs.luck == 0.5
    with pytest.raises(StabenchError, match="n_live must be an integer"):
        hs.HardSampleShortcuts(n_live=9)
    with pytest.raises(StabenchError, match="luck must be a number"):
        hs.HardSampleShortcuts(luck=0)
