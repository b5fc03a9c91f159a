"""degenerate-comparisons: the grades of an injected batch, the group-signal diagnostic and the variance filter
on constructed cases, the environment, the ground truth against a learner that does not learn, branching."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.aggregation import VarianceFilter
from stabench.suite.api import StabenchError, Stabilizer
from stabench.suite.diagnostics import group_signal, live_groups
from stabench.tasks import degenerate_comparisons as dc
from stabench.tasks.worlds import digits as dg

pytestmark = pytest.mark.smoke


def test_injected_batches_hold_one_live_group_and_constant_grades() -> None:
    grades = dc.degenerate_grades(8)
    assert grades == ["live"] + ["solved"] * 4 + ["unsolvable"] * 3
    reward = dc.graded_reward(grades, group_size=2)
    prompts = torch.tensor([[dg.N_ACTIONS, 1, 4]]).expand(16, -1)
    good, bad = [0, 2, 3], [5, 5, 5]
    answers = torch.tensor([good, bad] * 8)
    paid = reward(prompts, answers).view(8, 2).tolist()
    assert paid == [[1.0, 0.0]] + [[1.0, 1.0]] * 4 + [[0.0, 0.0]] * 3
    live = live_groups(torch.tensor(sum(paid, [])), torch.arange(8).repeat_interleave(2))
    assert live.tolist() == [True] + [False] * 7


def test_group_signal_counts_silent_groups_and_the_answers_left() -> None:
    group = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.2])
    assert group_signal(rewards, group) == {"zero_variance_share": 0.5, "effective_batch": 0.5}


def _batch(rewards: list[float]) -> dict[str, torch.Tensor]:
    """Two groups of two answers of two tokens: token-mean weights 1/8."""
    mask = torch.ones(4, 2)
    logp = torch.log(torch.full((4, 2), 0.5)).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0], [0.0, 0.0]])
    return {"logp": logp, "anchor_logp": logp.detach(), "advantages": adv, "mask": mask,
            "token_weight": mask / 8, "rewards": torch.tensor(rewards), "group": torch.tensor([0, 0, 1, 1]),
            "clip_low": torch.tensor(0.2), "clip_high": torch.tensor(0.2)}  # fmt: skip


def test_variance_filter_drops_silent_groups_from_every_term_and_keeps_the_total_weight() -> None:
    batch = _batch([1.0, 0.0, 1.0, 1.0])  # group 1 is all correct
    kl = torch.arange(8.0).view(4, 2)
    filtered = VarianceFilter().kl_loss(kl, batch)
    assert filtered[2:].abs().sum() == 0  # the silent group's KL is gone
    # what the trainer then takes, sum(kl * w): the mean over the live group's 4 tokens (0, 1, 2, 3)
    assert float((filtered * batch["token_weight"]).sum()) == pytest.approx(1.5)
    policy = VarianceFilter().loss({"policy": torch.tensor(9.0)}, batch)["policy"]
    # -A r over the live group's tokens, r = 1: (-1 - 1 + 1 + 1) / 4 = 0; its gradient is 2x the trainer's
    assert float(policy.detach()) == pytest.approx(0.0)
    policy.backward()
    assert torch.allclose(batch["logp"].grad[:2], torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))
    assert batch["logp"].grad[2:].abs().sum() == 0


def test_variance_filter_is_the_identity_when_every_group_compares() -> None:
    batch = _batch([1.0, 0.0, 0.0, 1.0])
    kl = torch.rand(4, 2)
    assert torch.allclose(VarianceFilter().kl_loss(kl, batch), kl)
    all_silent = _batch([1.0, 1.0, 0.0, 0.0])
    assert VarianceFilter().kl_loss(kl, all_silent).abs().sum() == 0  # nothing to compare: no update


def test_environment_passes_check_env_and_pays_by_grade() -> None:
    env = gym.make("stabench/DegenerateComparisons-v0").unwrapped
    check_env(env, skip_render_check=True)
    paid = {}
    for grade in dc.GRADES:
        env = dc.DegenerateComparisonsEnv(grade=grade)
        env.reset(seed=0)
        env.prompt = torch.tensor([[dg.N_ACTIONS, 1, 4]])
        paid[grade] = [env.step(x)[1] for x in (0, 2, 3)][-1]  # a correct answer
    assert paid == {"live": 1.0, "solved": 1.0, "unsolvable": 0.0}
    with pytest.raises(ValueError, match="grade must be one of"):
        dc.DegenerateComparisonsEnv(grade="easy")


def test_a_learner_that_does_not_learn_fails_the_ground_truth() -> None:
    assert dg.heldout_accuracy(dg.warm_policy()) < dc.ACCURACY_FLOOR


def test_branches_differ_in_the_silent_groups() -> None:
    task = dc.DegenerateComparisons()
    run = task.build("smoke", 0, Stabilizer())
    for _ in range(task.budget("smoke").onset):
        run.step(injected=False)
    row_i = copy.deepcopy(run).step(injected=True)
    row_c = copy.deepcopy(run).step(injected=False)
    assert row_i["zero_variance_share"] >= 7 / 8 and row_i["effective_batch"] <= 1 / 8
    assert row_c["zero_variance_share"] < 7 / 8
    assert {"return", "entropy", "heldout_accuracy", "full_vocab_kl"} <= set(row_i)


def test_knobs_are_checked() -> None:
    assert dc.DegenerateComparisons(n_live=2).knobs.n_live == 2
    with pytest.raises(StabenchError, match="n_live must be an integer"):
        dc.DegenerateComparisons(n_live=0)
