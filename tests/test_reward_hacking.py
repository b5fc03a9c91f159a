"""reward-hacking: the gold reward, the freezing injection, branching, the ensemble stabilizers, the knobs."""

from __future__ import annotations

import copy
import math
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.kl import KLk2Anchor
from stabench.baselines.stabilizers.reward_models import (
    ConservativeEnsemble,
    ConservativeEnsembleNoAnchor,
    conservative_reward,
    group_normalized,
)
from stabench.suite import registry
from stabench.suite.api import StabenchError, Stabilizer
from stabench.tasks import reward_hacking as rh

pytestmark = pytest.mark.smoke


def test_env_passes_check_env_and_pays_the_gold_reward() -> None:
    env = gym.make("stabench/RewardHacking-v0")
    check_env(env.unwrapped, skip_render_check=True)
    table = rh.gold_table()
    for answer, bonus in (([0, 0, 1, 3], 1.0), ([0, 0, 0, 0], -1.0), ([2, 0, 0, 0], -0.4), ([1, 2, 3, 4], 0.0)):
        env.reset(seed=0)
        rewards = [env.step(a)[1] for a in answer]
        expected = sum(table[t, a] for t, a in enumerate(answer)) + bonus
        assert rewards[:-1] == [0.0, 0.0, 0.0] and rewards[-1] == pytest.approx(expected)
    best = rh.ALL_ANSWERS[rh.GOLD_ALL.argmax()]
    assert int((best == rh.KEYWORD).sum()) == 2  # the best answer holds the keyword twice, not four times


def test_reference_writes_the_keyword_rarely_and_no_hack_or_frozen_policy_reaches_the_target() -> None:
    ref_logp = rh.all_logp(rh.reference_policy())
    pi = ref_logp.exp()
    keyword_share = float((pi * (rh.ALL_ANSWERS == rh.KEYWORD).float().mean(1)).sum())
    assert 0.02 < keyword_share < 0.04
    reference_gold = float((pi * rh.GOLD_ALL).sum())
    assert reference_gold == pytest.approx(rh.reference_distribution_gold(), abs=0.05)
    task = rh.RewardHacking()
    # The ground truth is the exact expected gold: the reference (no-update) and the policy frozen at onset
    # sit below the target, and so does every answer stuffed with three or four keywords (the hack).
    assert task.ground_truth.metric == "gold" and task.ground_truth.fails_when == "below"
    assert reference_gold < task.return_floor < rh.GOLD_TARGET < task.return_ceiling < float(rh.GOLD_ALL.max())
    stuffed = (rh.ALL_ANSWERS == rh.KEYWORD).sum(1) >= 3
    assert float(rh.GOLD_ALL[stuffed].max()) < rh.GOLD_TARGET
    assert float(rh.GOLD_ALL[~stuffed].max()) == pytest.approx(float(rh.GOLD_ALL.max()))


def test_the_policy_at_the_smoke_onset_is_below_the_target() -> None:
    torch.set_num_threads(1)
    task = rh.RewardHacking()
    run = task.build("smoke", 0, Stabilizer())
    rows = [run.step(False) for _ in range(task.budget("smoke").onset)]
    assert rows[-1]["gold"] < rh.GOLD_TARGET  # frozen here, the run fails


def _ensemble_state(run: rh.RewardHackingRun) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.ensemble.params]


def test_injection_freezes_the_ensemble_and_branches_share_the_healthy_rows() -> None:
    torch.set_num_threads(1)
    task = rh.RewardHacking()
    budget = task.budget("smoke")

    def rows(seed: int) -> tuple[list[dict], list[dict], rh.RewardHackingRun, rh.RewardHackingRun]:
        run = task.build("smoke", seed, Stabilizer())
        healthy = [run.step(False) for _ in range(budget.onset)]
        injected = copy.deepcopy(run)
        before = _ensemble_state(injected)
        tail_i = [injected.step(True) for _ in range(budget.iterations - budget.onset)]
        assert all(torch.equal(a, b) for a, b in zip(before, _ensemble_state(injected)))  # frozen from onset
        tail_c = [run.step(False) for _ in range(budget.iterations - budget.onset)]
        assert not all(torch.equal(a, b) for a, b in zip(before, _ensemble_state(run)))  # the control keeps fitting
        return healthy + tail_i, healthy + tail_c, injected, run

    injected, control, _, _ = rows(0)
    required = {"step", "return", "entropy", task.ground_truth.metric, task.detector.metric, "proxy", "gold",
                "proxy_gold_gap", "kl_k1", "kl_k3", "exact_kl"}  # fmt: skip
    for row in injected + control:
        assert required <= set(row)
        assert all(math.isfinite(row[k]) for k in required)
        assert row["return"] == row["gold"] and row["gt_gold_drop"] >= 0
    assert injected[: budget.onset] == control[: budget.onset]
    assert injected[-1] != control[-1]
    assert rows(0)[0] == injected  # the same seed twice gives identical rows
    assert rows(1)[0] != injected


def test_conservative_reward_and_group_normalization_by_hand() -> None:
    ensemble = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 4.0], [5.0, 5.0]], dtype=torch.float64)
    # mean [2, 2, 2, 5], unbiased std [sqrt 2, 0, sqrt 8, 0]
    reward = conservative_reward(ensemble, 1.5)
    expected = torch.tensor([2 - 1.5 * math.sqrt(2), 2.0, 2 - 1.5 * math.sqrt(8), 5.0], dtype=torch.float64)
    assert torch.allclose(reward, expected)
    group = torch.tensor([0, 0, 1, 1])
    adv = group_normalized(torch.tensor([1.0, 3.0, 2.0, 2.0]), group)
    # group 0: mean 2, std sqrt 2; group 1: all equal, advantage 0
    assert torch.allclose(adv, torch.tensor([-1 / (math.sqrt(2) + 1e-4), 1 / (math.sqrt(2) + 1e-4), 0.0, 0.0]))


def test_conservative_ensemble_hooks() -> None:
    members = torch.tensor([[1.0, 1.0, 1.0], [3.0, 0.0, 6.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.ones(4, 2)
    batch = {"reward_ensemble": members, "group": torch.tensor([0, 0, 1, 1]), "mask": mask}
    stab = ConservativeEnsemble()
    adv = stab.advantages(torch.zeros(4, 2), batch)
    # group 0: answer 1 has the higher mean (3 vs 1) but spread 3, so with k = 4 it scores 3 - 12 = -9 < 1.
    assert stab.k == 4.0
    assert adv[0, 0] > 0 > adv[1, 0] and torch.equal(adv[:, 0], adv[:, 1])
    assert adv[2, 0] < 0 < adv[3, 0]
    # without an ensemble there is nothing to be conservative about: it applies only where the task provides one
    assert stab.applies_to(rh.RewardHacking()) and "reward_ensemble" in rh.RewardHacking.provides
    assert not stab.applies_to(registry.get_task("kl-estimator-bias"))
    assert not ConservativeEnsembleNoAnchor().applies_to(registry.get_task("entropy-collapse"))
    # the anchor: 0.05 * sum(w * k2), k2 = d^2 / 2, d = ref_logp - logp, in place of the trainer's KL term
    kl_batch = {"logp": torch.tensor([[-0.1, -3.0]]), "ref_logp": torch.tensor([[-3.0, -0.1]]),
                "token_weight": torch.tensor([[0.25, 0.5]]), "kl_coef": torch.tensor(0.02)}
    expected = 0.05 * float((torch.tensor([0.25, 0.5]) * 0.5 * torch.tensor([2.9, 2.9]) ** 2).sum())
    assert KLk2Anchor.coef == 0.05 and isinstance(stab, KLk2Anchor)
    terms = {"policy": torch.tensor(1.0), "kl": torch.tensor(7.0)}
    for anchored in (KLk2Anchor().loss(dict(terms), kl_batch), stab.loss(dict(terms), kl_batch)):
        assert set(anchored) == {"policy", "kl"} and float(anchored["policy"]) == 1.0
        assert float(anchored["kl"]) == pytest.approx(expected, rel=1e-6)
    per_token = torch.tensor([0.3, 0.7])
    assert torch.equal(stab.kl_loss(per_token, kl_batch), per_token)  # the anchor goes through `loss` only
    ablation = ConservativeEnsembleNoAnchor()  # the same advantages, the trainer's KL term untouched
    assert ablation.k == stab.k and torch.equal(ablation.advantages(torch.zeros(4, 2), batch), adv)
    assert torch.equal(ablation.kl_loss(per_token, kl_batch), per_token)
    untouched = ablation.loss(dict(terms), kl_batch)
    assert set(untouched) == {"policy", "kl"} and float(untouched["kl"]) == 7.0


def _onset_message(value: object) -> str:
    return re.escape(
        f"reward-hacking: onset must be an integer in 1..82 (inside every quick and full run), got {value!r}"
    )


@pytest.mark.parametrize(("knobs", "message"), [
    ({"onset": -1}, _onset_message(-1)), ({"onset": 0}, _onset_message(0)), ({"onset": 83}, _onset_message(83)),
    ({"onset": 2.5}, _onset_message(2.5)), ({"onset": True}, _onset_message(True)),
    ({"ensemble_size": 1}, "reward-hacking: ensemble_size must be an integer >= 2, got 1"),
    ({"lag": 3}, "reward-hacking: unknown knob lag"),
])  # fmt: skip
def test_bad_knobs_raise(knobs: dict, message: str) -> None:
    with pytest.raises(StabenchError, match=message):
        rh.RewardHacking(**knobs)


def test_good_knobs_pass() -> None:
    assert rh.RewardHacking(onset=82, ensemble_size=2).knobs.ensemble_size == 2


def test_onset_knob_moves_the_onset() -> None:
    assert rh.RewardHacking(onset=20).budget("quick").onset == 20
    assert rh.RewardHacking(onset=20).budget("smoke").onset == rh.RewardHacking.budgets["smoke"].onset
