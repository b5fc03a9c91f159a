"""The trainers' and stabilizers' math on cases whose answers are known, where it once disagreed with verl's
reference implementation (`verl/trainer/ppo/core_algos.py`): GAE on answers of different lengths, GRPO on
groups of one answer; and the loss report's mean over updates on a trainer with several updates per iteration."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from stabench.baselines.grpo import GRPO, GRPOConfig
from stabench.baselines.stabilizers import aggregation, reward_models, rewards
from stabench.baselines.stabilizers.critics import gae
from stabench.baselines.tokens import group_std, tiny_policy
from stabench.suite.api import TRAINER_LOSSES, Stabilizer

pytestmark = pytest.mark.smoke


def test_gae_places_the_reward_after_each_answers_last_real_token():
    values, reward = torch.zeros(1, 4), torch.ones(1)
    ragged = gae(values, reward, 0.8, torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert torch.allclose(ragged, torch.tensor([[0.8, 1.0, 0.0, 0.0]]))  # GAE with R after token 2 of 2
    # the same answer padded without a mask would see R two tokens too late: the bug, as it was
    assert torch.allclose(gae(values, reward, 0.8)[:, :2], torch.tensor([[0.512, 0.64]]))
    # a batch of two lengths, values non-zero: each row equals GAE on its own unpadded answer
    values = torch.tensor([[0.1, 0.4, 0.9, 0.3], [0.2, 0.5, 0.7, 0.6]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    reward = torch.tensor([1.0, 0.0])
    both = gae(values, reward, 0.5, mask)
    assert torch.allclose(both[0, :3], gae(values[:1, :3], reward[:1], 0.5)[0]) and both[0, 3] == 0.0
    assert torch.equal(both[1], gae(values[1:], reward[1:], 0.5)[0])


def test_gae_with_a_full_mask_is_bit_for_bit_the_unmasked_gae():
    gen = torch.Generator().manual_seed(0)
    values, reward = torch.randn(16, 5, generator=gen), torch.randn(16, generator=gen)
    assert torch.equal(gae(values, reward, 0.8, torch.ones(16, 5)), gae(values, reward, 0.8))


def test_group_std_of_a_group_of_one_is_one_and_otherwise_torchs():
    r = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    assert torch.equal(group_std(r), r.std(1, keepdim=True))
    assert torch.equal(group_std(torch.tensor([[3.0], [0.0]])), torch.ones(2, 1))


class Advantages(Stabilizer):
    """Records the advantages the trainer computed."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def advantages(self, advantages, batch):
        self.seen.append(advantages.clone())
        return advantages


def reward_first_token_is_one(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    return (answers[:, 0] == 1).float()


@pytest.mark.parametrize("baseline", ["group", "batch"])
def test_grpo_groups_of_one_answer_get_finite_advantages_and_train(baseline):
    torch.manual_seed(0)
    cfg = GRPOConfig(n_groups=8, group_size=1, answer_len=2, n_actions=3, baseline=baseline)
    stab = Advantages()
    trainer = GRPO(tiny_policy(3, 3), tiny_policy(3, 3), reward_first_token_is_one, cfg, stab)
    state = trainer.iterate()
    adv = stab.seen[0]
    assert torch.isfinite(adv).all()
    r = state.batch["rewards"]
    if baseline == "group":  # an answer alone in its group is compared with nothing: no push either way
        assert torch.equal(adv, torch.zeros_like(adv))
    else:  # std taken as 1 (verl's convention): the batch-centred reward
        assert torch.allclose(adv[:, 0], (r - r.mean()) / (1 + cfg.adv_eps))
    assert all(math.isfinite(v) for v in state.losses.values())


def test_grpo_reports_each_loss_as_the_mean_over_its_updates():
    torch.manual_seed(0)
    cfg = GRPOConfig(n_groups=4, group_size=4, answer_len=3, n_actions=3, epochs=2, minibatches=2)

    class Terms(Stabilizer):
        def __init__(self) -> None:
            self.terms: list[dict[str, float]] = []

        def loss(self, terms, batch):
            self.terms.append({k: float(v.detach()) for k, v in terms.items()})
            return terms

    stab = Terms()
    state = GRPO(tiny_policy(3, 4), tiny_policy(3, 4), reward_first_token_is_one, cfg, stab).iterate()
    assert len(stab.terms) == 4 and set(state.losses) == TRAINER_LOSSES["grpo"]
    policy = [t["policy"] for t in stab.terms]
    assert len(set(policy)) > 1  # the updates differ, so the mean is not the last
    assert state.losses["policy_loss"] == pytest.approx(np.mean(policy), rel=1e-6)
    assert state.losses["kl_loss"] == pytest.approx(np.mean([t["kl"] for t in stab.terms]) / cfg.beta, rel=1e-6)
    assert state.losses["loss"] == pytest.approx(np.mean([sum(t.values()) for t in stab.terms]), rel=1e-6)
    assert state.extras["loss_terms"] == stab.terms[-1]


def test_group_normalized_is_defined_once():
    assert rewards.group_normalized is aggregation.group_normalized
    assert reward_models.group_normalized is aggregation.group_normalized
    assert not hasattr(rewards, "ADV_EPS") and not hasattr(reward_models, "ADV_EPS")
    assert aggregation.ADV_EPS == GRPOConfig.adv_eps
    group = torch.tensor([0, 0, 1, 1, 2])  # the last group has one answer: advantage 0, not NaN
    adv = aggregation.group_normalized(torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0]), group)
    assert torch.allclose(adv, torch.tensor([0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4), 0, 0, 0]))
