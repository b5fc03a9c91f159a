"""entropy-collapse: environment, rewards, exact held-out evaluation, branching, knobs, the clip-higher file."""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from baselines.stabilizers.clip_higher import ClipHigher, GRPOEntropyBonus, GRPOKLAnchor
from suite.api import StabenchError, Stabilizer
from tasks import entropy_collapse as ec

pytestmark = pytest.mark.smoke

X, Y = [0, 1, 2], [3, 4, 0]  # two answers


def _group(*answers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.tensor(answers)
    return torch.tensor([[ec.BOS, 5, 5]]).expand(len(a), -1), a


def test_correct_avoids_both_prompt_digits() -> None:
    prompts = torch.tensor([[ec.BOS, 1, 4]] * 4)
    answers = torch.tensor([[0, 2, 3], [0, 1, 3], [4, 2, 3], [5, 5, 5]])
    assert ec.correct(prompts, answers).tolist() == [1.0, 0.0, 0.0, 1.0]
    n_good = ec.HELDOUT_CORRECT.sum(-1).tolist()
    assert n_good == [125.0 if a == b else 64.0 for a, b in ec.HELDOUT_PAIRS]


def test_majority_vote_rewards_the_group_mode_only() -> None:
    distinct = [[i, j, 0] for i in range(2) for j in range(4)]
    assert ec.majority_vote(*_group(*distinct)).tolist() == [0.0] * 8  # no answer repeats: no majority
    group = [X, X, X, Y, Y, [0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert ec.majority_vote(*_group(*group)).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    tie = [X, X, Y, Y, [0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 3]]
    assert ec.majority_vote(*_group(*tie)).tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    two_groups = torch.cat([_group(*group)[1], _group(*distinct)[1]])
    prompts = torch.tensor([[ec.BOS, 5, 5]]).expand(16, -1)
    assert ec.majority_vote(prompts, two_groups).tolist() == [1, 1, 1, 0, 0, 0, 0, 0] + [0] * 8


@pytest.mark.parametrize("injected", [False, True])
def test_env_passes_check_env_and_pays_the_trainers_rewards(injected: bool) -> None:
    env = gym.make("stabench/EntropyCollapse-v0", injected=injected)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=3)
    prompt = torch.tensor([[ec.BOS, *obs[:2].tolist()]])
    group = [X, X, X, Y, Y, [0, 0, 0], [1, 1, 1], [2, 2, 2]]
    rewards = [env.step(t)[1] for answer in group for t in answer]
    answers = torch.tensor(group)
    if injected:
        assert rewards[:-1] == [0.0] * 23
        assert rewards[-1] == float(ec.majority_vote(prompt.expand(8, -1), answers).sum()) == 3.0
    else:
        paid = [rewards[i] for i in range(2, 24, 3)]
        assert paid == ec.correct(prompt.expand(8, -1), answers).tolist()
        assert sum(rewards) == sum(paid)


def test_heldout_evaluation_is_exact_and_bounds_are_the_constants() -> None:
    torch.manual_seed(0)
    model = ec.tiny_policy(ec.N_ACTIONS, ec.PROMPT_LEN + ec.ANSWER_LEN)
    logp = ec.heldout_logp(model)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(len(ec.HELDOUT_PROMPTS), dtype=torch.float64))
    # spot-check one entry against a direct forward
    p, a = ec.HELDOUT_PROMPTS[2], ec.ALL_ANSWERS[77]
    with torch.no_grad():
        lp = torch.log_softmax(ec.answer_logits(model, p[None], a[None], ec.N_ACTIONS).double(), -1)
    assert float(logp[2, 77]) == pytest.approx(float(lp[0].gather(-1, a[:, None]).sum()), abs=1e-6)
    # a policy that always writes one correct answer covers 1 / 8; one that always writes a wrong one covers 0
    one = torch.full_like(logp, -math.inf)
    one[:, 215] = 0.0  # answer 5 5 5: correct unless the prompt holds a 5
    expected = [0.0 if 5 in pair else 1 / 8 for pair in ec.HELDOUT_PAIRS]
    assert ec.coverage(one).tolist() == pytest.approx(expected)
    floor, ceiling = ec.coverage_bounds()
    task = ec.EntropyCollapse()
    assert (task.return_floor, task.return_ceiling) == pytest.approx((floor, ceiling), abs=1e-9)
    assert 0.125 < ceiling < 1.0


def test_branching_is_paired_and_deterministic() -> None:
    torch.set_num_threads(1)
    task = ec.EntropyCollapse()
    budget = task.budget("smoke")

    def rows(seed: int) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
        run = task.build("smoke", seed, Stabilizer())
        healthy = [run.step(False) for _ in range(budget.onset)]
        branch = copy.deepcopy(run)
        tail_i = [branch.step(True) for _ in range(budget.iterations - budget.onset)]
        tail_c = [run.step(False) for _ in range(budget.iterations - budget.onset)]
        return healthy + tail_i, healthy + tail_c

    injected, control = rows(0)
    required = {"step", "return", "entropy", "entropy_trend", "reward", "heldout_accuracy", task.ground_truth.metric}
    for row in injected + control:
        assert required <= set(row)
        assert all(math.isfinite(row[k]) for k in required)
    assert injected[: budget.onset] == control[: budget.onset]
    assert injected[-1] != control[-1]
    assert injected[-1]["step"] == budget.iterations * 8 * 8 * 3
    assert rows(0)[0] == injected


def test_clip_higher_formula_on_a_hand_computed_case() -> None:
    logp = torch.tensor([[math.log(1.5), math.log(1.25), math.log(0.5), math.log(1.1)]])
    batch = {
        "logp": logp, "old_logp": torch.zeros(1, 4), "advantages": torch.tensor([[1.0, 1.0, -1.0, -2.0]]),
        "token_weight": torch.full((1, 4), 0.25),
    }  # fmt: skip
    # ratios 1.5, 1.25, 0.5, 1.1: A>0 clipped at 1.28 and 1.25 (inside); A<0 clipped at 0.8 -> -min(-0.5, -0.8) = 0.8
    expected = 0.25 * (-1.28 - 1.25 + 0.8 + 2.2)
    out = ClipHigher().loss({"policy": torch.tensor(0.0)}, batch)
    assert float(out["policy"]) == pytest.approx(expected)
    batch["logp"] = logp.clone().requires_grad_(True)
    ClipHigher().loss({}, batch)["policy"].backward()
    grad = batch["logp"].grad[0]
    assert grad[0] == 0.0 and grad[2] == 0.0  # clipped tokens carry no gradient
    assert float(grad[1]) == pytest.approx(-0.25 * 1.25)


def test_entropy_bonus_gradient_is_minus_the_entropy_gradient() -> None:
    logits = torch.tensor([0.3, -0.2, 1.0], requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    probs = logp_all.exp().detach()
    # expected surrogate over all tokens (on-policy, r = 1): sum_x pi(x) * coef * logp(x).detach() * ratio(x)
    total = torch.zeros(())
    for x in range(3):
        lp = logp_all[x : x + 1][None]
        batch = {"logp": lp, "old_logp": lp.detach(), "token_weight": torch.ones(1, 1)}
        total = total + probs[x] * GRPOEntropyBonus().loss({}, batch)["entropy"]
    (grad,) = torch.autograd.grad(total, logits, retain_graph=True)
    entropy = -(logp_all.exp() * logp_all).sum()
    (ent_grad,) = torch.autograd.grad(entropy, logits)
    assert torch.allclose(grad, -GRPOEntropyBonus.coef * ent_grad, atol=1e-6)


def test_kl_anchor_is_k3_times_coef() -> None:
    logp, ref = torch.tensor([[-0.1, -3.0]]), torch.tensor([[-3.0, -0.1]])
    batch = {"logp": logp, "ref_logp": ref, "token_weight": torch.full((1, 2), 0.5)}
    d = ref - logp
    expected = GRPOKLAnchor.coef * 0.5 * float((torch.expm1(d) - d).sum())
    out = GRPOKLAnchor().loss({"policy": torch.tensor(1.0)}, batch)
    assert float(out["kl_anchor"]) == pytest.approx(expected) and float(out["policy"]) == 1.0


@pytest.mark.parametrize("onset", [-1, 0, 60, 1000, 2.5, True])
def test_bad_onset_raises(onset: object) -> None:
    with pytest.raises(StabenchError, match="onset"):
        ec.EntropyCollapse(onset=onset)


def test_good_onset_moves_the_quick_onset_and_unknown_knob_raises() -> None:
    assert ec.EntropyCollapse(onset=25).budget("quick").onset == 25
    with pytest.raises(StabenchError, match="unknown knob"):
        ec.EntropyCollapse(fix="clip")
