"""The token family: environment, KL estimators, exact enumeration, the KL stabilizers, kl-estimator-bias plumbing."""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from baselines.stabilizers.kl_estimators import KLk1InReward, KLk2InLoss, KLMaxInLoss
from suite.api import Stabilizer
from suite.diagnostics import exact_kl, kl_estimators
from tasks import kl_estimator_bias as task_module
from tasks.tokens import all_answers_logp, prefix_logp, tiny_policy

pytestmark = pytest.mark.smoke


@pytest.mark.parametrize("injected", [False, True])
def test_env_passes_check_env_and_pays_the_task_reward(injected: bool) -> None:
    env = gym.make("stabench/KLTokens-v0", injected=injected)
    check_env(env.unwrapped, skip_render_check=True)
    answer = [0, 5, 2, 5]
    env.reset(seed=0)
    rewards = [env.step(a)[1] for a in answer]
    reward_fn = task_module.rare_token_share if injected else task_module.first_token_zero
    expected = float(reward_fn(torch.tensor([[6]]), torch.tensor([answer]))[0])
    assert rewards[:-1] == [0.0, 0.0, 0.0] and rewards[-1] == pytest.approx(expected)
    assert expected == pytest.approx(2 / 3 if injected else 1.0)


def test_k1_k3_unbiased_k2_biased() -> None:
    q = torch.tensor([0.7, 0.2, 0.1])  # the sampler (policy)
    p = torch.tensor([0.1, 0.2, 0.7])  # the reference
    true_kl = float(exact_kl(q.log(), p.log()))
    gen = torch.Generator().manual_seed(0)
    x = torch.multinomial(q, 200_000, replacement=True, generator=gen)
    est = {k: float(v.mean()) for k, v in kl_estimators(q.log()[x], p.log()[x]).items()}
    assert est["k1"] == pytest.approx(true_kl, abs=0.02)
    assert est["k3"] == pytest.approx(true_kl, abs=0.03)
    assert est["k2"] - true_kl > 0.3  # E[k2] = 1.515 here against KL 1.168


def test_exact_sequence_kl_is_the_sum_of_per_step_kls() -> None:
    n_actions, length = 3, 3
    torch.manual_seed(0)
    pi, ref = tiny_policy(n_actions, length + 1), tiny_policy(n_actions, length + 1)
    bos = torch.tensor([n_actions])
    with torch.no_grad():
        pi_prefix, ref_prefix = prefix_logp(pi, bos, length, n_actions), prefix_logp(ref, bos, length, n_actions)
    lp, lr = all_answers_logp(pi_prefix), all_answers_logp(ref_prefix)
    assert float(lp.exp().sum()) == pytest.approx(1.0, abs=1e-9)
    sequence_kl = float((lp.exp() * (lp - lr)).sum())
    # Chain rule: E_{x ~ pi} sum_t KL(pi(.|x<t) || ref(.|x<t)). Answer x sits in row x[:-1] of the prefix
    # tables (answers are enumerated prefix-major), and every step's KL depends only on that row.
    step_kl = (pi_prefix.exp() * (pi_prefix - ref_prefix)).sum(-1).sum(-1)  # [n_prefix]
    row_prob = lp.exp().view(len(step_kl), n_actions).sum(1)
    per_step_sum = float((row_prob * step_kl).sum())
    assert sequence_kl == pytest.approx(per_step_sum, rel=1e-9)
    assert sequence_kl > 0


def test_k1_in_reward_advantage_transform() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    ref_logp = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -3.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    batch = {"logp": logp, "ref_logp": ref_logp, "mask": mask, "kl_coef": torch.tensor(0.5)}
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    # k1 = logp - ref_logp: [[0.5, -1, 0], [0, 2, (1, masked)]]; kl to go: [[-0.5, -1, 0], [2, 2, 0]].
    expected = torch.tensor([[1.25, 1.5, 1.0], [-2.0, -2.0, 0.0]])
    stab = KLk1InReward()
    assert torch.allclose(stab.advantages(adv, batch), expected)
    assert torch.equal(stab.kl_loss(torch.ones(2, 3), batch), torch.zeros(2, 3))


def test_kl_in_loss_variants() -> None:
    logp = torch.tensor([-0.1, -3.0])  # token 0: policy over-weights it (d < 0); token 1: under-weights (d > 0)
    ref_logp = torch.tensor([-3.0, -0.1])
    batch = {"logp": logp, "ref_logp": ref_logp}
    est = kl_estimators(logp, ref_logp)
    assert torch.allclose(KLk2InLoss().kl_loss(est["k3"], batch), est["k2"])
    chosen = KLMaxInLoss().kl_loss(est["k3"], batch)
    assert torch.allclose(chosen, torch.stack([est["k2"][0], est["k3"][1]]))


def test_task_plumbing_policy_starts_at_reference_and_is_deterministic() -> None:
    torch.set_num_threads(1)
    task = task_module.KLEstimatorBias()
    budget = task.budget("smoke")

    def rows(seed: int) -> tuple[float, list[dict[str, float]], list[dict[str, float]]]:
        run = task.build("smoke", seed, Stabilizer())
        kl0 = float((task_module.all_logp(run.trainer.policy) - run.ref_logp).abs().max())
        healthy = [run.step(False) for _ in range(budget.onset)]
        injected = copy.deepcopy(run)
        tail_i = [injected.step(True) for _ in range(budget.iterations - budget.onset)]
        tail_c = [run.step(False) for _ in range(budget.iterations - budget.onset)]
        return kl0, healthy + tail_i, healthy + tail_c

    kl0, injected, control = rows(0)
    assert kl0 == 0.0
    required = {"step", "return", "entropy", "reward", task.ground_truth.metric, task.detector.metric}
    required |= {"kl_k1", "kl_k2", "kl_k3", "kl_full_vocab", "kl_k2_over_k3", "grad_norm_total"}
    for row in injected + control:
        assert required <= set(row)
        assert all(math.isfinite(row[k]) for k in required - {"kl_k2_over_k3"})
    assert injected[budget.onset]["step"] == (budget.onset + 1) * 16 * 8 * 4
    assert injected[: budget.onset] == control[: budget.onset]
    assert injected[-1] != control[-1]
    assert rows(0)[1] == injected  # the same seed twice gives identical rows


def test_return_bounds_are_the_exact_values() -> None:
    floor, ceiling = task_module.regularized_bounds()
    task = task_module.KLEstimatorBias()
    # The constants are fixed per task version; recomputed on another CPU (AMD EPYC vs Intel Xeon) the
    # reference's warm-up sums floats in another order and the floor moves by 2e-5.
    assert task.return_floor == pytest.approx(floor, abs=1e-3)
    assert task.return_ceiling == pytest.approx(ceiling, abs=1e-3)
    assert task.return_floor < 0 < task.return_ceiling
