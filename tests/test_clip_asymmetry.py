"""clip-asymmetry: the rules and the environment, the analytic Zipf warm start, the exact statistics, the
ground truth against a learner that never updates, the reuse schedule of each branch, branching, knobs."""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.suite import registry
from stabench.suite.api import POLICY_REUSE, StabenchError, Stabilizer
from stabench.tasks import clip_asymmetry as ca

pytestmark = pytest.mark.smoke


def test_the_new_rule_pays_only_its_tail_tokens_and_the_old_one_the_head() -> None:
    answers = torch.arange(ca.N_ACTIONS)[:, None]
    prompts = ca.PROMPTS.expand(ca.N_ACTIONS, -1)
    new = ca.correct_new(prompts, answers)
    assert torch.nonzero(new).squeeze(-1).tolist() == list(ca.CORRECT)
    assert all(token >= ca.TAIL_START for token in ca.CORRECT)
    assert ca.correct_old(prompts, answers).tolist() == [1.0] * ca.TAIL_START + [0.0] * (ca.N_ACTIONS - ca.TAIL_START)


@pytest.mark.parametrize("after_onset", [False, True])
def test_env_passes_check_env_and_pays_the_trainers_rule(after_onset: bool) -> None:
    env = gym.make("stabench/ClipAsymmetry-v0", after_onset=after_onset)
    check_env(env.unwrapped, skip_render_check=True)
    rule = ca.correct_new if after_onset else ca.correct_old
    for token in (0, ca.CORRECT[0], ca.N_ACTIONS - 1):
        env.reset(seed=0)
        _, reward, done, _, _ = env.step(token)
        assert done and reward == float(rule(ca.PROMPTS, torch.tensor([[token]]))[0])


def test_the_warm_start_is_zipf_exactly_and_the_same_whatever_the_callers_seed() -> None:
    torch.manual_seed(123)
    logp = ca.answer_logp(ca.warm_policy())
    torch.manual_seed(7)
    state = torch.random.get_rng_state()
    again = ca.answer_logp(ca.warm_policy())
    assert torch.equal(torch.random.get_rng_state(), state)  # building it leaves the caller's random state alone
    assert torch.equal(logp, again)  # and does not depend on it
    zipf = torch.tensor([(v + 1.0) ** -ca.ZIPF for v in range(ca.N_ACTIONS)], dtype=torch.float64)
    assert torch.allclose(logp.exp(), zipf / zipf.sum(), atol=1e-6)
    pi = logp.exp()
    assert pi[ca.TAIL_START:].max() < 0.02 and pi[0] > 0.25  # a head and a long tail
    assert all(0.005 < float(pi[t]) < 0.015 for t in ca.CORRECT)  # the new rule's answers start near 1%


def test_exact_stats_of_hand_made_policies() -> None:
    model = ca.warm_policy()
    stats = ca.exact_stats(model)
    pi = ca.answer_logp(model).exp()
    expected = sum(1 - (1 - float(pi[t])) ** ca.GROUP_SIZE for t in ca.CORRECT)
    assert stats["gt_expected_distinct"] == pytest.approx(expected)
    assert stats["return"] == pytest.approx(expected / ca.GROUP_SIZE)
    assert stats["correct_mass"] == pytest.approx(float(pi[list(ca.CORRECT)].sum()))
    assert stats["policy_entropy"] == pytest.approx(float(-(pi * pi.log()).sum()))
    # a policy uniform over the correct answers reaches the optimum; one on a single correct answer covers 1
    with torch.no_grad():
        model.transformer.wte.weight[: ca.N_ACTIONS, 0] = -1e4
        model.transformer.wte.weight[list(ca.CORRECT), 0] = 0.0
    uniform = ca.exact_stats(model)
    optimum = ca.N_CORRECT * (1 - (1 - 1 / ca.N_CORRECT) ** ca.GROUP_SIZE)
    assert uniform["gt_expected_distinct"] == pytest.approx(optimum)
    assert uniform["live_correct"] == ca.N_CORRECT and uniform["policy_entropy"] == pytest.approx(math.log(5))
    with torch.no_grad():
        model.transformer.wte.weight[list(ca.CORRECT[1:]), 0] = -1e4
    assert ca.exact_stats(model)["gt_expected_distinct"] == pytest.approx(1.0)


def test_the_ground_truth_separates_keeping_four_answers_from_keeping_three() -> None:
    task = ca.ClipAsymmetry()
    threshold = task.ground_truth.threshold

    def kept(n: int) -> float:
        return n * (1 - (1 - 1 / n) ** ca.GROUP_SIZE)

    assert kept(3) < threshold < kept(4)
    assert task.return_floor < task.return_ceiling
    warm = ca.exact_stats(ca.warm_policy())
    # a learner that never updates keeps the warm start: it fails the ground truth
    assert warm["gt_expected_distinct"] < threshold
    assert POLICY_REUSE in task.provides  # so that the methods that act only under reuse act here
    assert all(registry.make_stabilizer(m).applies_to(task) for m in (*task.methods[1:], "cispo"))


def test_only_the_injected_branch_reuses_its_batches_and_branching_is_paired() -> None:
    torch.set_num_threads(1)
    task = ca.ClipAsymmetry()
    budget = task.budget("smoke")

    def rows(seed: int) -> tuple[list[dict[str, float]], list[dict[str, float]], ca.ClipAsymmetryRun]:
        run = task.build("smoke", seed, Stabilizer())
        healthy = [run.step(False) for _ in range(budget.onset)]
        assert (run.trainer.config.epochs, run.trainer.config.minibatches) == (1, 1)
        branch = copy.deepcopy(run)
        tail_i = [branch.step(True) for _ in range(budget.iterations - budget.onset)]
        assert (branch.trainer.config.epochs, branch.trainer.config.minibatches) == (
            ca.REUSE_EPOCHS, ca.REUSE_MINIBATCHES)
        tail_c = [run.step(False) for _ in range(budget.iterations - budget.onset)]
        assert (run.trainer.config.epochs, run.trainer.config.minibatches) == (1, 1)
        assert branch.trainer.config.seed == run.trainer.config.seed == seed
        return healthy + tail_i, healthy + tail_c, branch

    injected, control, _ = rows(0)
    required = {"step", "return", "entropy", "entropy_trend", "reward", "clip_frac", task.ground_truth.metric}
    for row in injected + control:
        assert required <= set(row) and all(math.isfinite(row[k]) for k in required)
    assert injected[: budget.onset] == control[: budget.onset]
    # one on-policy step per batch: the ratio is 1 and nothing is clipped; reuse moves the ratio
    assert all(row["clip_frac"] == 0.0 for row in control)
    assert injected[-1] != control[-1]
    assert rows(0)[0] == injected


@pytest.mark.parametrize("onset", [-1, 0, 40, 2.5, True])
def test_bad_onset_raises(onset: object) -> None:
    with pytest.raises(StabenchError, match=r"clip-asymmetry: onset must be an integer in 1\.\.39"):
        ca.ClipAsymmetry(onset=onset)


def test_good_onset_moves_the_quick_onset_and_unknown_knob_raises() -> None:
    assert ca.ClipAsymmetry(onset=10).budget("quick").onset == 10
    with pytest.raises(StabenchError, match="unknown knob"):
        ca.ClipAsymmetry(reuse=2)
