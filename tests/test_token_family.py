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
from stabench.baselines.stabilizers.kl import KLk1InReward, KLk2InLoss, KLMaxInLoss
from stabench.suite.api import Stabilizer
from stabench.suite.diagnostics import exact_kl, kl_estimators
from stabench.tasks import kl_estimator_bias as task_module
from stabench.tasks.worlds.tokens import all_answers_logp, prefix_logp, tiny_policy

pytestmark = pytest.mark.smoke


@pytest.mark.parametrize(("injected", "post_onset"), [(False, False), (False, True), (True, True)])
def test_env_passes_check_env_and_pays_the_task_reward(injected: bool, post_onset: bool) -> None:
    env = gym.make("stabench/KLTokens-v0", injected=injected, post_onset=post_onset)
    check_env(env.unwrapped, skip_render_check=True)
    answer = [0, 4, 5, 2]  # the goal prefix (0, 4), then the rare token at position 2 of the two rare positions
    env.reset(seed=0)
    rewards = [env.step(a)[1] for a in answer]
    expected = {(False, False): 1.0, (False, True): 8.0, (True, True): 8.0 + 4.0 / 2}[(injected, post_onset)]
    assert rewards[:-1] == [0.0, 0.0, 0.0] and rewards[-1] == pytest.approx(expected)
    assert task_module.GOAL == (0, 4) and task_module.GOAL_REWARD == 8.0 and task_module.RARE_REWARD == 4.0


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
    required |= {"gt_exact_kl", "goal_mass", "rare_share", "exact_reward"}
    required |= {"kl_k1", "kl_k2", "kl_k3", "kl_full_vocab", "kl_k2_over_k3", "grad_norm_total"}
    for row in injected + control:
        assert required <= set(row)
        assert all(math.isfinite(row[k]) for k in required - {"kl_k2_over_k3"})
        assert row["return"] == pytest.approx(row["exact_reward"] - task_module.BETA * row["gt_exact_kl"])
    assert injected[budget.onset]["step"] == (budget.onset + 1) * 16 * 8 * 4
    assert injected[: budget.onset] == control[: budget.onset]
    # After onset both branches are paid for the goal; only the injected branch also for rare tokens.
    goal, rare = task_module.GOAL_REWARD, task_module.RARE_REWARD
    for i, c in zip(injected[budget.onset :], control[budget.onset :], strict=True):
        assert i["exact_reward"] == pytest.approx(goal * i["goal_mass"] + rare * i["rare_share"], rel=1e-6)
        assert c["exact_reward"] == pytest.approx(goal * c["goal_mass"], rel=1e-6)
    assert injected[budget.onset - 1]["exact_reward"] < 1  # the healthy reward pays 1 at most
    assert rows(0)[1] == injected  # the same seed twice gives identical rows


def _post_onset_objective(pi: torch.Tensor, ref_logp: torch.Tensor, reward: torch.Tensor) -> float:
    logp = pi.clamp_min(1e-300).log()
    return float((pi * reward).sum() - task_module.BETA * (pi * (logp - ref_logp)).sum())


def test_ceiling_is_the_exact_regularized_optimum_and_the_reference_cannot_pass() -> None:
    task = task_module.KLEstimatorBias()
    ceiling = task_module.goal_ceiling()
    ref_logp = task_module.all_logp(task_module.reference_policy())
    prompts = task_module.BOS.expand(len(task_module.ALL_ANSWERS), 1)
    reward = task_module.goal_and_rare(prompts, task_module.ALL_ANSWERS).double()
    optimum = torch.softmax(ref_logp + reward / task_module.BETA, 0)  # pi* ∝ ref exp(R / beta)
    assert _post_onset_objective(optimum, ref_logp, reward) == pytest.approx(ceiling, rel=1e-9)
    # The reference (what a learner that never updates keeps) is worth far less.
    reference_value = _post_onset_objective(ref_logp.exp(), ref_logp, reward)
    assert reference_value < ceiling - 5
    # The constant is fixed per task version; another CPU's warm-up moves the reference slightly.
    assert task.return_ceiling == pytest.approx(ceiling, abs=1e-3)
    # A learner that never updates (the reference) and one frozen at onset (the floor) fail the ground truth;
    # the optimum passes it.
    gt = task.ground_truth
    assert gt.fails_when == "below" and gt.reduce == "tail_mean"
    assert reference_value < task.return_floor < gt.threshold < ceiling
    # k3's end state: the optimum with the rare token tilted up to k3's equilibrium share (3/4 at positions
    # 2-3, see the next test) collects more reward but loses about 1 of the objective to the KL; a learner's
    # other tokens also stay short of the optimum (the control ends near 5.6), so that loss takes it below the
    # threshold, which sits less than 0.3 under the control's end.
    rare = (task_module.ALL_ANSWERS[:, task_module.RARE_POSITIONS] == task_module.RARE).double().sum(1)
    low, high = 0.0, 20.0
    for _ in range(60):  # bisection on the tilt that gives a rare-token share of 3/4
        tilt = (low + high) / 2
        tilted = torch.softmax(optimum.log() + tilt * rare, 0)
        low, high = (tilt, high) if float((tilted * rare).sum()) / 2 < 3 / 4 else (low, tilt)
    assert float((tilted * reward).sum()) > float((optimum * reward).sum())
    assert _post_onset_objective(tilted, ref_logp, reward) < ceiling - 0.9


def _equilibrium(kl_loss, ref: torch.Tensor, reward: torch.Tensor, beta: float, steps: int = 3000) -> torch.Tensor:
    """One categorical trained on the EXPECTED on-policy GRPO loss (Dr. GRPO advantages, the KL term through
    `kl_loss`), as the trainer's token loss averages it over samples; returns where Adam settles."""
    logits = ref.log().clone().requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=0.05)
    for _ in range(steps):
        logp = torch.log_softmax(logits, 0)
        pi = logp.exp().detach()  # the sampling distribution: no gradient, like the batch of samples
        adv = reward - (pi * reward).sum()
        k3 = torch.expm1(ref.log() - logp) - (ref.log() - logp)
        kl = kl_loss(k3, {"logp": logp, "ref_logp": ref.log()})
        loss = (pi * (-adv * logp + beta * kl)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.softmax(logits.detach(), 0)


def test_k3_in_the_loss_lets_a_rewarded_rare_token_run_away_and_kl_max_holds_it() -> None:
    """The mechanism on one token position: the rare token (reference 0.003) is paid r = RARE_REWARD / 2.

    The reverse-KL-regularized optimum multiplies its probability by exp(r / beta) (to about 0.14); k3 in
    the loss has the forward KL's gradient, whose equilibrium (1 - p) r = beta (1 - ref / p) puts p near
    1 - beta / r = 3/4; max(k2, k3) in the loss (k2 where the policy over-weights) stays near the optimum.
    """
    beta, r = task_module.BETA, task_module.RARE_REWARD / 2
    ref = torch.tensor([0.3, 0.3, 0.2, 0.197, 0.003], dtype=torch.float64)
    reward = torch.tensor([0.0, 0.0, 0.0, 0.0, r], dtype=torch.float64)
    optimum = ref * torch.exp(reward / beta)
    optimum = optimum / optimum.sum()
    k3_p = _equilibrium(lambda k3, batch: k3, ref, reward, beta)
    max_p = _equilibrium(KLMaxInLoss().kl_loss, ref, reward, beta)
    assert float(k3_p[-1]) == pytest.approx(1 - beta / r, abs=0.03)
    assert float(max_p[-1]) < 2 * float(optimum[-1]) < 0.3
    assert float(exact_kl(k3_p.log(), ref.log())) > 3 > 0.5 > float(exact_kl(max_p.log(), ref.log()))
