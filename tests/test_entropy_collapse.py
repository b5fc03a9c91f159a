"""entropy-collapse: environment, rewards (the new rule, the vote), exact held-out evaluation, the ground truth
against a learner that never updates, branching, knobs, the clip-higher file."""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.clipping import ClipHigher
from stabench.baselines.stabilizers.entropy import EntropyBonus, EntropyBonusLow
from stabench.baselines.stabilizers.kl import KLAnchor
from stabench.suite.api import StabenchError, Stabilizer
from stabench.tasks import entropy_collapse as ec
from stabench.tasks.worlds import digits as dg
from stabench.tasks.worlds.tokens import answer_logits, tiny_policy

pytestmark = pytest.mark.smoke

X, Y = [0, 1, 2], [3, 4, 0]  # two answers


def _group(*answers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.tensor(answers)
    return torch.tensor([[dg.BOS, 5, 5]]).expand(len(a), -1), a


def test_correct_avoids_both_prompt_digits_and_the_new_rule_also_bans_five() -> None:
    prompts = torch.tensor([[dg.BOS, 1, 4]] * 5)
    answers = torch.tensor([[0, 2, 3], [0, 1, 3], [4, 2, 3], [5, 5, 5], [0, 5, 2]])
    assert dg.correct(prompts, answers).tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert dg.correct_new(prompts, answers).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    # no held-out prompt holds a 5, so the new rule leaves 3 (a != b) or 4 (a = b) digits per position
    n_good = dg.HELDOUT_CORRECT.sum(-1).tolist()
    pairs = dg.HELDOUT_PROMPTS[:, 1:].tolist()
    assert sorted(map(tuple, pairs)) == sorted(dg.HELDOUT_PAIRS)
    assert n_good == [64.0 if a == b else 27.0 for a, b in pairs]
    assert dg.HELDOUT_OLD.sum(-1).tolist() == [125.0 if a == b else 64.0 for a, b in pairs]


def test_gold_and_vote_pays_the_verifier_on_the_first_groups_and_the_vote_on_the_rest() -> None:
    g = dg.GROUP_SIZE
    wrong_mode = [[5, 5, 5]] * 5 + [[0, 2, 3], [2, 0, 3], [3, 2, 0]]  # the mode is wrong under the new rule
    answers = torch.tensor(wrong_mode * dg.GRPO_CONFIG.n_groups)
    prompts = torch.tensor([[dg.BOS, 1, 4]]).expand(len(answers), -1)
    paid = ec.gold_and_vote(prompts, answers).view(-1, g)
    gold = [0.0] * 5 + [1.0] * 3
    vote = [1.0] * 5 + [0.0] * 3
    assert paid.tolist() == [gold] * ec.N_GOLD_GROUPS + [vote] * (dg.GRPO_CONFIG.n_groups - ec.N_GOLD_GROUPS)
    assert 0 < ec.N_GOLD_GROUPS < dg.GRPO_CONFIG.n_groups


def test_majority_vote_rewards_the_group_mode_only() -> None:
    distinct = [[i, j, 0] for i in range(2) for j in range(4)]
    assert ec.majority_vote(*_group(*distinct)).tolist() == [0.0] * 8  # no answer repeats: no majority
    group = [X, X, X, Y, Y, [0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert ec.majority_vote(*_group(*group)).tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    tie = [X, X, Y, Y, [0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 3]]
    assert ec.majority_vote(*_group(*tie)).tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    two_groups = torch.cat([_group(*group)[1], _group(*distinct)[1]])
    prompts = torch.tensor([[dg.BOS, 5, 5]]).expand(16, -1)
    assert ec.majority_vote(prompts, two_groups).tolist() == [1, 1, 1, 0, 0, 0, 0, 0] + [0] * 8


@pytest.mark.parametrize(("injected", "after_onset"), [(False, False), (False, True), (True, True)])
def test_env_passes_check_env_and_pays_the_trainers_rewards(injected: bool, after_onset: bool) -> None:
    env = gym.make("stabench/EntropyCollapse-v0", injected=injected, after_onset=after_onset)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=3)
    prompt = torch.tensor([[dg.BOS, *obs[:2].tolist()]])
    group = [X, X, X, Y, Y, [0, 0, 0], [1, 1, 1], [5, 5, 5]]
    rewards = [env.step(t)[1] for answer in group for t in answer]
    answers = torch.tensor(group)
    if injected:
        assert rewards[:-1] == [0.0] * 23
        assert rewards[-1] == float(ec.majority_vote(prompt.expand(8, -1), answers).sum()) == 3.0
    else:
        rule = dg.correct_new if after_onset else dg.correct
        paid = [rewards[i] for i in range(2, 24, 3)]
        assert paid == rule(prompt.expand(8, -1), answers).tolist()
        assert sum(rewards) == sum(paid)


def test_heldout_evaluation_is_exact_and_the_optimum_is_uniform_over_the_correct_answers() -> None:
    torch.manual_seed(0)
    model = tiny_policy(dg.N_ACTIONS, dg.PROMPT_LEN + dg.ANSWER_LEN)
    logp = dg.heldout_logp(model)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(len(dg.HELDOUT_PROMPTS), dtype=torch.float64))
    # spot-check one entry against a direct forward
    p, a = dg.HELDOUT_PROMPTS[2], dg.ALL_ANSWERS[77]
    with torch.no_grad():
        lp = torch.log_softmax(answer_logits(model, p[None], a[None], dg.N_ACTIONS).double(), -1)
    assert float(logp[2, 77]) == pytest.approx(float(lp[0].gather(-1, a[:, None]).sum()), abs=1e-6)
    # a policy that always writes one correct answer covers 1 / 8; one that always writes a wrong one covers 0
    one = torch.full_like(logp, -math.inf)
    one[:, 215] = 0.0  # answer 5 5 5: wrong under the new rule on every held-out prompt
    assert dg.coverage(one).tolist() == [0.0] * len(dg.HELDOUT_PAIRS)
    one[:, 215], one[:, 0] = -math.inf, 0.0  # answer 0 0 0: correct unless the prompt holds a 0
    expected = [0.0 if 0 in pair else 1 / 8 for pair in dg.HELDOUT_PROMPTS[:, 1:].tolist()]
    assert dg.coverage(one).tolist() == pytest.approx(expected)
    # the exact optimum (uniform over the correct answers) beats a random perturbation of it
    uniform = (dg.HELDOUT_CORRECT / dg.HELDOUT_CORRECT.sum(-1, keepdim=True)).log()
    optimum = dg.coverage_optimum()
    assert float(dg.coverage(uniform).mean()) == pytest.approx(optimum)
    tilted = uniform.exp() * (1 + 0.5 * torch.rand(uniform.shape, dtype=torch.float64)) * dg.HELDOUT_CORRECT
    assert float(dg.coverage((tilted / tilted.sum(-1, keepdim=True)).log()).mean()) < optimum


def test_floor_and_ceiling_order_and_the_warm_start_fails_the_ground_truth() -> None:
    task = ec.EntropyCollapse()
    assert task.return_floor < task.return_ceiling < dg.coverage_optimum()
    stats = dg.heldout_stats(dg.warm_policy())
    # a learner that never updates keeps the warm start: it must fail the ground truth and score near the floor
    assert stats["gt_expected_distinct"] < task.ground_truth.threshold
    assert stats["gt_expected_distinct"] == pytest.approx(8 * stats["return"])
    assert abs(task.normalized_return(stats["return"])) < 0.25
    assert stats["heldout_accuracy"] < 0.5 < stats["old_rule_accuracy"]


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
    # before onset the old rule pays (at least what the new one would); after it the control is paid the new rule
    assert all(row["reward"] >= row["train_accuracy"] for row in control[: budget.onset])
    assert all(row["reward"] == row["train_accuracy"] for row in control[budget.onset :])
    assert injected[-1] != control[-1]
    assert injected[-1]["step"] == budget.iterations * 8 * 8 * 3
    assert rows(0)[0] == injected


def test_clip_higher_formula_on_a_hand_computed_case() -> None:
    logp = torch.tensor([[math.log(1.5), math.log(1.25), math.log(0.5), math.log(1.1)]])
    batch = {
        "logp": logp, "anchor_logp": torch.zeros(1, 4), "advantages": torch.tensor([[1.0, 1.0, -1.0, -2.0]]),
        "token_weight": torch.full((1, 4), 0.25), "clip_low": torch.tensor(0.2), "clip_high": torch.tensor(0.2),
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
    logits = torch.tensor([[0.3, -0.2, 1.0], [2.0, 0.0, -1.0]], requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [2]: per-action entropy with the graph, as trainers hand it
    weight = torch.tensor([0.25, 0.75])
    batch = {"entropy": entropy[None], "token_weight": weight[None]}
    out = EntropyBonus().loss({"policy": torch.tensor(1.0)}, batch)
    assert set(out) == {"policy", "entropy_bonus"} and float(out["policy"]) == 1.0
    assert EntropyBonus.coef == 0.05 and EntropyBonusLow.coef == 0.01
    assert float(out["entropy_bonus"].detach()) == pytest.approx(-0.05 * float((weight * entropy).detach().sum()))
    (grad,) = torch.autograd.grad(out["entropy_bonus"], logits, retain_graph=True)
    (ent_grad,) = torch.autograd.grad((weight * entropy).sum(), logits, retain_graph=True)
    assert torch.allclose(grad, -0.05 * ent_grad, atol=1e-7) and float(ent_grad.abs().sum()) > 0
    low = EntropyBonusLow().loss({}, batch)["entropy_bonus"]
    assert float(low.detach()) == pytest.approx(-0.01 * float((weight * entropy).detach().sum()))


def test_kl_anchor_is_k3_times_coef() -> None:
    logp, ref = torch.tensor([[-0.1, -3.0]]), torch.tensor([[-3.0, -0.1]])
    batch = {"logp": logp, "ref_logp": ref, "token_weight": torch.full((1, 2), 0.5)}
    d = ref - logp
    assert KLAnchor.coef == 0.3
    expected = 0.3 * 0.5 * float((torch.expm1(d) - d).sum())
    out = KLAnchor().loss({"policy": torch.tensor(1.0), "kl": torch.tensor(2.0)}, batch)
    assert float(out["kl_anchor"]) == pytest.approx(expected) and float(out["policy"]) == 1.0
    assert float(out["kl"]) == 2.0  # beside the trainer's own KL term, not in its place


@pytest.mark.parametrize("onset", [-1, 0, 60, 1000, 2.5, True])
def test_bad_onset_raises(onset: object) -> None:
    message = r"entropy-collapse: onset must be an integer in 1\.\.49 \(inside every quick and full run\), got"
    with pytest.raises(StabenchError, match=message):
        ec.EntropyCollapse(onset=onset)


def test_good_onset_moves_the_quick_onset_and_unknown_knob_raises() -> None:
    assert ec.EntropyCollapse(onset=25).budget("quick").onset == 25
    with pytest.raises(StabenchError, match="unknown knob"):
        ec.EntropyCollapse(fix="clip")
