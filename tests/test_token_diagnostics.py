"""Token-family diagnostics on constructed cases whose answers are known, and the GRPO options they read."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from stabench.baselines.grpo import GRPO, GRPOConfig, aggregate_tokens, token_weights
from stabench.suite.api import Stabilizer, TrainState
from stabench.suite.diagnostics import (
    DIAGNOSTICS,
    categorical_entropy,
    effective_sample_size,
    explained_variance,
    gradient_variance,
    ratio_tails,
)
from stabench.tasks.worlds.tokens import tiny_policy

pytestmark = pytest.mark.smoke


def state(batch: dict, extras: dict) -> TrainState:
    return TrainState(model=torch.nn.Linear(1, 1), batch=batch, grads={}, losses={}, extras=extras)


def test_entropy_of_known_distributions() -> None:
    uniform = torch.zeros(3, 8)
    assert torch.allclose(categorical_entropy(uniform), torch.full((3,), math.log(8)))
    two_point = torch.log(torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert float(categorical_entropy(two_point)) == pytest.approx(math.log(2))
    assert float(categorical_entropy(torch.tensor([0.0, -1e4]))) == pytest.approx(0.0, abs=1e-6)


def test_gradient_variance_of_known_gradients() -> None:
    # Four minibatch gradients around the mean (1, 0): deviations (+-1, 0) and (0, +-2).
    grads = [torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, -2.0])]
    trace, rel = gradient_variance(grads)
    assert trace == pytest.approx((1 + 1 + 4 + 4) / 3)
    assert rel == pytest.approx(trace / 1.0)
    same = [torch.tensor([3.0, 4.0])] * 5
    assert gradient_variance(same) == (0.0, 0.0)
    assert all(math.isnan(v) for v in gradient_variance(grads[:1]))
    # Sampled: K gradients with independent N(mu, s^2) coordinates have E[trace] = d s^2.
    gen = torch.Generator().manual_seed(0)
    many = [torch.randn(50, generator=gen) * 0.5 + 1.0 for _ in range(400)]
    assert gradient_variance(many)[0] == pytest.approx(50 * 0.25, rel=0.05)


def test_effective_sample_size_of_known_weights() -> None:
    assert effective_sample_size(torch.ones(10)) == pytest.approx(1.0)
    one_hot = torch.zeros(10)
    one_hot[3] = 5.0
    assert effective_sample_size(one_hot) == pytest.approx(0.1)  # one sample carries everything
    # Half the weights 1, half 3: (sum w)^2 / (N sum w^2) = 20^2 / (10 * 50) = 0.8.
    w = torch.tensor([1.0] * 5 + [3.0] * 5)
    assert effective_sample_size(w) == pytest.approx(20**2 / (10 * (5 + 45)))
    assert math.isnan(effective_sample_size(torch.zeros(0)))


def test_ratio_tails_split_by_tool_state() -> None:
    ratio = torch.ones(4, 100)
    ratio[0, :] = torch.linspace(1, 10, 100)  # the tool row has a heavy tail
    mask = torch.ones(4, 100)
    tool = torch.zeros(4, 100, dtype=torch.bool)
    tool[0] = True
    row = DIAGNOSTICS["ratio_tails"](state({"mask": mask}, {"ratio": ratio, "tool_mask": tool}))
    assert row["ratio_p99_text"] == pytest.approx(1.0) and row["ratio_ess_text"] == pytest.approx(1.0)
    assert row["ratio_p99_tool"] == pytest.approx(float(torch.quantile(ratio[0], 0.99)))
    tail = torch.linspace(1, 10, 100)
    assert row["ratio_ess_tool"] == pytest.approx(float(tail.sum() ** 2 / (100 * tail.pow(2).sum())))
    assert 1.0 < row["ratio_p99"] < row["ratio_p99_tool"]  # the aggregate dilutes the tool tail
    p99, ess = ratio_tails(ratio, torch.zeros(4, 100))
    assert math.isnan(p99) and math.isnan(ess)


def test_explained_variance_and_value_fit() -> None:
    returns = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert explained_variance(returns, returns) == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 1.5), returns) == pytest.approx(0.0)
    assert explained_variance(returns + 1, returns) == pytest.approx(1.0)  # a constant offset is not variance
    assert explained_variance(-returns, returns) == pytest.approx(1 - 4 * 1.25 / 1.25)
    row = DIAGNOSTICS["value_fit"](state({}, {"values": returns + 1, "returns": returns}))
    assert row["value_error"] == pytest.approx(1.0)
    assert math.isnan(DIAGNOSTICS["value_fit"](state({}, {}))["value_explained_variance"])


def test_lengths_and_reward_disagreement() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    row = DIAGNOSTICS["lengths"](state({"mask": mask}, {}))
    assert row["length_mean"] == pytest.approx(2.75) and row["length_cap_share"] == pytest.approx(0.5)
    preds = torch.tensor([[0.0, 1.0], [2.0, 1.0]])  # 2 members x 2 answers: std 1.414 and 0
    dis = DIAGNOSTICS["reward_disagreement"](state({}, {"reward_ensemble": preds}))["rm_disagreement"]
    assert dis == pytest.approx(math.sqrt(2) / 2)


def test_token_weights_reproduce_each_aggregation() -> None:
    gen = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, generator=gen)
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]).float()
    for how in ("token-mean", "seq-mean", "constant"):
        weighted = float((per_token * token_weights(mask, how)).sum())
        assert weighted == pytest.approx(float(aggregate_tokens(per_token, mask, how)))
    # seq-mean weights long answers less per token: the length bias Dr. GRPO removes.
    w = token_weights(mask, "seq-mean")
    assert w[0, 0] < w[2, 0]
    assert torch.allclose(token_weights(mask, "constant")[mask.bool()], torch.tensor(1 / 30))


class Recorder(Stabilizer):
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def advantages(self, advantages: torch.Tensor, batch) -> torch.Tensor:
        self.seen.append({"adv": advantages.clone(), "rewards": batch["rewards"].clone(), "extra": batch["extra"]})
        return advantages

    def loss(self, terms, batch):
        self.seen.append({"mb_rows": len(batch["answers"]), "keys": set(batch)})
        return terms


def test_grpo_batch_baseline_minibatches_and_reward_extras() -> None:
    torch.manual_seed(0)
    policy, ref = tiny_policy(3, 4), tiny_policy(3, 4)
    cfg = GRPOConfig(n_groups=4, group_size=4, answer_len=3, n_actions=3, baseline="batch", std_normalize=False,
                     minibatches=2, epochs=2, aggregation="constant")
    stab = Recorder()

    def reward(prompts: torch.Tensor, answers: torch.Tensor) -> dict:
        r = (answers[:, 0] == 1).float()
        return {"reward": r, "extra": r * 10}

    state_ = GRPO(policy, ref, reward, cfg, stab).iterate()
    adv, rewards = stab.seen[0]["adv"], stab.seen[0]["rewards"]
    assert torch.allclose(adv[:, 0], rewards - rewards.mean())  # batch-mean baseline, no std division
    assert torch.equal(stab.seen[0]["extra"], rewards * 10)  # the reward's extras reach the hooks
    updates = stab.seen[1:]
    assert [u["mb_rows"] for u in updates] == [8, 8, 8, 8]  # 2 epochs x 2 minibatches of 2 whole groups
    assert {"advantages", "token_weight", "clip_low", "clip_high"} <= updates[0]["keys"]
    assert len(state_.extras["minibatch_grads"]) == 2
    row = DIAGNOSTICS["grad_variance"](state_)
    assert np.isfinite(row["grad_var"]) and row["grad_var"] > 0
