"""value-cold-start: the chain environment, token-PPO's GAE, the critic reset, branching, the stabilizers, knobs."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.critics import CriticWarmup
from stabench.baselines.stabilizers.entropy import EntropyBonus
from stabench.baselines.token_ppo import PrefixCritic, gae, terminal_rewards
from stabench.suite.api import StabenchError, Stabilizer
from stabench.tasks import value_cold_start as vcs
from stabench.tasks.worlds.tokens import sample_answers, tiny_policy

pytestmark = pytest.mark.smoke


@pytest.mark.parametrize("switched", [False, True])
def test_env_passes_check_env_and_pays_the_chain(switched: bool) -> None:
    env = gym.make("stabench/ValueColdStart-v0", switched=switched)
    check_env(env.unwrapped, skip_render_check=True)
    answer = [1, 2, 3, 3, 1]  # moves +1 +1 0 +2: valid under {1, 2} for 2 steps then broken; under {0, 3}: none
    env.reset(seed=0)
    rewards = [env.step(a)[1] for a in answer]
    assert rewards[:-1] == [0.0] * 4
    assert rewards[-1] == pytest.approx(0.0 if switched else 0.5)


def test_chain_counts_only_leading_valid_steps() -> None:
    answers = torch.tensor([[0, 3, 3, 2, 1], [0, 0, 1, 1, 0], [2, 3, 0, 2, 3], [3, 2, 1, 0, 3]])
    # {3}: moves 3 0 3 3 -> 1 leading valid; 0 1 0 3 -> 0; 1 1 2 1 -> 0; 3 3 3 3 -> all 4.
    assert torch.allclose(vcs.REWARD_AFTER(None, answers), torch.tensor([0.25, 0.0, 0.0, 1.0]))
    # {1, 2}: 3 0 3 3 -> 0; 0 ... -> 0; 1 1 2 1 -> all 4; 3 ... -> 0.
    assert torch.allclose(vcs.REWARD_BEFORE(None, answers), torch.tensor([0.0, 0.0, 1.0, 0.0]))


def test_a_learner_that_never_learns_fails_the_new_rule() -> None:
    # The uniform policy (what `no-update` keeps, up to its init) earns (1/4 + 1/16 + 1/64 + 1/256) / 4 on the new
    # rule: below the ground truth's threshold and within 0.1 of the floor in normalized return.
    uniform = float(vcs.REWARD_AFTER(None, vcs.ALL_ANSWERS).double().mean())
    assert uniform == pytest.approx((1 / 4 + 1 / 16 + 1 / 64 + 1 / 256) / 4)
    task = vcs.ValueColdStart()
    assert uniform < task.ground_truth.threshold and task.normalized_return(uniform) <= 0.1
    # The healthy rule's moves are all invalid after onset: the answer the old rule pays fully earns 0.
    assert float(vcs.REWARD_AFTER(None, torch.tensor([[0, 1, 2, 3, 0]]))) == 0.0


def test_gae_on_a_hand_computed_case() -> None:
    # Two answers of 3 tokens, terminal reward; the second ends after 2 tokens (mask), gamma 1, lambda 0.5.
    values = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = terminal_rewards(torch.tensor([4.0, 2.0]), mask)
    assert torch.equal(rewards, torch.tensor([[0.0, 0.0, 4.0], [0.0, 2.0, 0.0]]))
    adv, targets = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # Row 0: deltas 2-1=1, 3-2=1, 4-3=1; A2 = 1, A1 = 1 + 0.5*1 = 1.5, A0 = 1 + 0.5*1.5 = 1.75.
    # Row 1: deltas -1-0.5=-1.5, 2-(-1)=3 (terminal: no V after); A1 = 3, A0 = -1.5 + 0.5*3 = 0; masked 0.
    assert torch.allclose(adv, torch.tensor([[1.75, 1.5, 1.0], [0.0, 3.0, 0.0]]))
    assert torch.allclose(targets, torch.tensor([[2.75, 3.5, 4.0], [0.5, 2.0, 0.0]]))
    # gamma 0.5: row 0 deltas 0.5*2-1=0, 0.5*3-2=-0.5, 4-3=1; A2 = 1, A1 = -0.5+0.25 = -0.25, A0 = 0-0.0625.
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert torch.allclose(adv[0], torch.tensor([-0.0625, -0.25, 1.0]))


def test_table_sampler_matches_ancestral_sampling() -> None:
    torch.manual_seed(0)
    policy = tiny_policy(vcs.N_ACTIONS, vcs.ANSWER_LEN + 1)
    prompts = torch.full((1000, 1), vcs.N_ACTIONS)
    a = vcs.TableSampler()(policy, prompts, vcs.ANSWER_LEN, vcs.N_ACTIONS, np.random.default_rng(1))
    b = sample_answers(policy, prompts, vcs.ANSWER_LEN, vcs.N_ACTIONS, np.random.default_rng(1))
    assert (a == b).float().mean() > 0.999  # same uniforms, same inverse CDF (float sums may differ in the last bit)


def test_critic_scale_sets_the_spread_of_a_fresh_head() -> None:
    answers = torch.randint(0, vcs.N_ACTIONS, (256, vcs.ANSWER_LEN), generator=torch.Generator().manual_seed(0))
    spreads = []
    for scale in (1.0, 30.0):
        torch.manual_seed(0)
        with torch.no_grad():
                spreads.append(float(PrefixCritic(vcs.N_ACTIONS, vcs.ANSWER_LEN, out_scale=scale)(None, answers).std()))
    assert spreads[1] == pytest.approx(30 * spreads[0], rel=1e-4)


def _rows(run, start: int, stop: int, injected: bool) -> list[dict]:
    return [run.step(injected) for _ in range(start, stop)]


def test_branches_share_the_healthy_phase_and_are_deterministic() -> None:
    task = vcs.ValueColdStart()
    budget = task.budget("smoke")

    def trial() -> tuple[list[dict], list[dict], list[dict], object]:
        torch.manual_seed(0)
        run = task.build("smoke", 0, Stabilizer())
        shared = _rows(run, 0, budget.onset, False)
        inj, ctl = copy.deepcopy(run), copy.deepcopy(run)
        return shared, _rows(inj, budget.onset, budget.iterations, True), _rows(ctl, budget.onset,
                                                                                budget.iterations, False), inj

    shared, injected, control, inj_run = trial()
    shared2, injected2, control2, _ = trial()
    assert shared == shared2 and injected == injected2 and control == control2
    for row in shared + injected + control:
        for column in ("step", "return", "entropy", "value_error", "value_explained_variance", "success"):
            assert column in row
    # The injection is the critic reset: the injected branch's critic is young, the control's is not.
    assert injected[0]["critic_age"] == 0 and control[0]["critic_age"] == budget.onset
    assert inj_run.trainer.critic_resets == 1
    assert injected[0]["value_error"] > 3 * control[0]["value_error"]
    # Both branches switch the rule at onset: the same policy sampled both first post-onset batches.
    assert injected[0]["return"] == pytest.approx(control[0]["return"])


def test_critic_warmup_keeps_only_the_value_loss_after_a_reset() -> None:
    new_values = torch.tensor([[1.0, 2.0], [0.0, 0.5]], requires_grad=True)
    batch = {
        "critic_age": torch.tensor(3), "critic_resets": torch.tensor(1), "new_values": new_values,
        "mc_returns": torch.tensor([[1.0, 1.0], [0.0, 0.0]]), "token_weight": torch.full((2, 2), 0.25),
        "returns": torch.full((2, 2), 9.0),  # the trainer's bootstrapped targets: the warm-up must not read them
    }  # fmt: skip
    terms = {"policy": torch.tensor(5.0), "value": torch.tensor(7.0), "entropy": torch.tensor(-1.0)}
    fix = CriticWarmup()
    out = fix.loss(terms, batch)
    # 0.25 * 0.5 * (0 + 1 + 0 + 0.25) = 0.15625
    assert set(out) == {"value"} and float(out["value"].detach()) == pytest.approx(0.15625)
    assert fix.loss(terms, {**batch, "critic_age": torch.tensor(fix.iterations)}) == terms
    assert fix.loss(terms, {**batch, "critic_resets": torch.tensor(0)}) == terms


def test_entropy_guard_adds_the_bonus() -> None:
    batch = {"entropy": torch.tensor([[1.0, 0.5]]), "token_weight": torch.tensor([[0.5, 0.5]])}
    out = EntropyBonus().loss({"policy": torch.tensor(1.0), "entropy": torch.tensor(0.0)}, batch)
    assert float(out["entropy_bonus"]) == pytest.approx(-0.05 * 0.75) and float(out["policy"]) == 1.0
    assert float(out["entropy"]) == 0.0  # added beside the trainer's own entropy term, not in its place
    assert EntropyBonus().applies_to(vcs.ValueColdStart())


@pytest.mark.parametrize("knobs", [{"critic_scale": 0.0}, {"critic_scale": float("nan")}, {"critic_scale": "30"},
                                   {"unknown": 1}])
def test_bad_knobs_raise(knobs: dict) -> None:
    with pytest.raises(StabenchError, match=next(iter(knobs))):
        vcs.ValueColdStart(**knobs)


@pytest.mark.parametrize("onset", [-1, 0, 90, 10_000, 2.5, True])
def test_bad_onset_raises(onset: object) -> None:
    message = f"value-cold-start: onset must be an integer in 1..89 (inside every quick and full run), got {onset!r}"
    with pytest.raises(StabenchError) as raised:
        vcs.ValueColdStart(onset=onset)
    assert str(raised.value) == message


def test_good_knob_moves_the_onset() -> None:
    assert vcs.ValueColdStart(onset=20).budget("quick").onset == 20
