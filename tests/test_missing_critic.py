"""missing-critic: the walk-chain environment, the rewards, exact success, branching, the mini-critics' math."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.critics import MiniCritics, gae
from stabench.suite.api import StabenchError, Stabilizer
from stabench.tasks import missing_critic as mc
from stabench.tasks.worlds.tokens import tiny_policy

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)


@pytest.mark.parametrize("injected", [False, True])
def test_env_passes_check_env_and_pays_the_branch_reward(injected: bool) -> None:
    env = gym.make("stabench/WalkChain-v0", injected=injected, kind=mc.LONG)
    check_env(env.unwrapped, skip_render_check=True)
    right = mc.correct_chain(1)[0].tolist()
    answer = right[:-1] + [(right[-1] + 1) % mc.N_ACTIONS]  # every sub-step right but the last
    env.reset(seed=0)
    rewards = [env.step(a)[1] for a in answer]
    assert rewards[:-1] == [0.0] * (mc.CHAIN_LEN - 1)
    assert rewards[-1] == pytest.approx(0.0 if injected else (mc.CHAIN_LEN - 1) / mc.CHAIN_LEN)


def test_chain_is_a_walk_and_rewards_score_each_kind() -> None:
    assert mc.correct_chain(1, 6).tolist() == [[2, 3, 0, 1, 2, 3]]
    right = mc.correct_chain(1)[0]
    wrong_late = right.clone()
    wrong_late[-1] = (wrong_late[-1] + 1) % mc.N_ACTIONS
    wrong_early = right.clone()
    wrong_early[1] = (wrong_early[1] + 1) % mc.N_ACTIONS
    answers = torch.stack([wrong_late, wrong_late, right, wrong_early])
    prompts = torch.tensor([[mc.BOS_ID, mc.SHORT], [mc.BOS_ID, mc.LONG], [mc.BOS_ID, mc.LONG], [mc.BOS_ID, mc.SHORT]])
    assert mc.sparse_reward(prompts, answers).tolist() == [1.0, 0.0, 1.0, 0.0]
    n = mc.CHAIN_LEN
    assert mc.dense_reward(prompts, answers).tolist() == pytest.approx([(n - 1) / n, (n - 1) / n, 1.0, (n - 1) / n])


def test_exact_success_is_the_product_of_next_token_probabilities() -> None:
    torch.manual_seed(0)
    model = tiny_policy(mc.N_ACTIONS, mc.PROMPTS.shape[1] + mc.CHAIN_LEN, **mc.MODEL)
    chain = mc.correct_chain(1)[0].tolist()
    got = mc.exact_success(model)
    for kind, length, value in ((mc.LONG, mc.CHAIN_LEN, got[0]), (mc.SHORT, mc.SHORT_LEN, got[2])):
        seq, prob = [mc.BOS_ID, kind], 1.0
        with torch.no_grad():
            for token in chain[:length]:  # one forward per sub-step, as a sampler would see it
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1, : mc.N_ACTIONS].double()
                prob *= float(torch.softmax(logits, -1)[token])
                seq.append(token)
        assert value == pytest.approx(prob, rel=1e-6)
    assert 0 < got[0] < got[2] < 1


def _rows(run: mc.MissingCriticRun, injected: bool, n: int) -> list[dict[str, float]]:
    return [run.step(injected) for _ in range(n)]


def test_same_seed_same_rows_and_branches_share_the_healthy_phase() -> None:
    task = mc.MissingCritic()
    a, b = task.build("smoke", 0, Stabilizer()), task.build("smoke", 0, Stabilizer())
    onset = task.budget("smoke").onset
    healthy = _rows(a, False, onset)
    assert healthy == _rows(b, False, onset)
    branch = copy.deepcopy(a)
    injected, control = _rows(a, True, 2), _rows(branch, False, 2)
    assert _rows(b, True, 2) == injected
    assert [r["reward"] for r in injected] != [r["reward"] for r in control]
    assert {"step", "return", "entropy", "gt_success", "grad_var", "grad_var_rel"} <= set(injected[0])


def test_gae_by_hand() -> None:
    values, rewards = torch.tensor([[0.2, 0.5]]), torch.tensor([1.0])
    # delta = [0.5 - 0.2, 1.0 - 0.5]; A_1 = 0.5, A_0 = 0.3 + 0.5 * 0.5
    assert torch.allclose(gae(values, rewards, 0.5), torch.tensor([[0.55, 0.5]]))
    assert torch.allclose(gae(values, rewards, 1.0), torch.tensor([[0.8, 0.5]]))  # R - V(s_t)


def _critic_batch(rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    n = len(rewards)
    answers = torch.arange(n * mc.CHAIN_LEN).reshape(n, mc.CHAIN_LEN) % mc.N_ACTIONS
    return {"prompts": mc.PROMPTS[-1:].expand(n, -1), "answers": answers, "mask": torch.ones(n, mc.CHAIN_LEN),
            "rewards": rewards, "group": torch.arange(n) // 4}


def test_each_mini_critic_learns_only_from_its_own_share() -> None:
    spec = {"model_config": {"vocab_size": mc.N_ACTIONS + 1, "n_positions": mc.PROMPTS.shape[1] + mc.CHAIN_LEN},
            "answer_len": mc.CHAIN_LEN, "seed": 0}
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    changed = rewards.clone()
    changed[1::2] = 1 - changed[1::2]  # the odd members of each group: critic 1's share only
    fits = []
    for r in (rewards, changed):
        stab = MiniCritics()
        stab.model(torch.nn.Linear(1, 1), spec)
        adv = stab.advantages(torch.zeros(8, mc.CHAIN_LEN), _critic_batch(r))
        assert adv.shape == (8, mc.CHAIN_LEN)
        assert torch.allclose(adv.sum(0), torch.zeros(mc.CHAIN_LEN), atol=1e-5)  # centred at each position
        fits.append([torch.cat([p.detach().flatten() for p in c.parameters()]) for c in stab.critics])
    assert torch.equal(fits[0][0], fits[1][0])
    assert not torch.equal(fits[0][1], fits[1][1])


@pytest.mark.parametrize("onset", [-1, 0, 45, 10_000, "7", True])
def test_bad_onset_raises(onset: object) -> None:
    message = f"missing-critic: onset must be an integer in 1..44 (inside every quick and full run), got {onset!r}"
    with pytest.raises(StabenchError) as raised:
        mc.MissingCritic(onset=onset)
    assert str(raised.value) == message


def test_good_onset_moves_the_quick_tier_only() -> None:
    task = mc.MissingCritic(onset=10)
    assert task.budget("quick").onset == 10 and task.budget("smoke").onset == mc.MissingCritic.budgets["smoke"].onset


def test_a_learner_frozen_at_onset_fails_and_scores_the_floor() -> None:
    """Version 2: the long chain is still to be learned at onset; the policy frozen there keeps its exact LONG
    success (constant after onset, in both branches), below the ground truth's threshold."""
    from stabench.suite.trial import TrialSpec, run_trial

    rows = run_trial(TrialSpec("missing-critic", "frozen-at-onset", 0, "smoke", detectors=()))
    onset = mc.MissingCritic().budget("smoke").onset
    post = rows[rows["iteration"] >= onset]
    at_onset = rows.loc[rows["iteration"] == onset - 1, "gt_success"].iloc[0]  # after the last healthy update
    assert set(post["gt_success"]) == {at_onset}  # both branches keep the onset policy exactly
    assert rows.loc[rows["iteration"] == 0, "gt_success"].iloc[0] != at_onset  # it did learn before onset
    task = mc.MissingCritic()
    assert post["gt_success"].iloc[0] < task.ground_truth.threshold
    assert 0 < task.return_floor < task.ground_truth.threshold and task.return_ceiling > task.return_floor
