"""length-explosion: environment, rewards and the replay injection, the new problems, batches, the policy's rules,
exact quantities, branching, stabilizers."""

from __future__ import annotations

import copy
import re

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.grpo import aggregate_tokens
from stabench.baselines.stabilizers.aggregation import ConstantNorm, DrGRPO
from stabench.baselines.stabilizers.architecture import MarkovianChunks
from stabench.baselines.stabilizers.entropy import EntropyBonus
from stabench.suite.api import StabenchError, Stabilizer
from stabench.tasks import length_explosion as le

pytestmark = pytest.mark.smoke

T, E = le.THINK, le.EOS


def pad(tokens: list[int]) -> list[int]:
    return tokens + [E] * (le.ANSWER_LEN - len(tokens))


def test_env_passes_check_env_pays_the_task_reward_and_truncates_at_the_cap() -> None:
    env = gym.make("stabench/LengthExplosion-v0")
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=3)
    a, b, mode = (int(x) for x in obs[:3])
    right = (le.N_DIGITS * a + b + le.NEW_SHIFT * mode) % le.N_ANSWERS + 1
    assert env.step(T)[1:4] == (0.0, False, False) and env.step(T)[1:4] == (0.0, False, False)
    assert env.step(right)[1:3] == (1.0, True)
    old_id = le.N_DIGITS * a + b  # the same digits as an old problem, on the replay's scale
    replayed = gym.make("stabench/LengthExplosion-v0", replay_scale=5.0, ids=(old_id,))
    replayed.reset(seed=3)
    replayed.step(T), replayed.step(T)
    assert replayed.step((le.N_DIGITS * a + b) % le.N_ANSWERS + 1)[1:3] == (5.0, True)
    env.reset(seed=3)
    steps = [env.step(T) for _ in range(le.CAP)]
    assert [s[3] for s in steps] == [False] * (le.CAP - 1) + [True]  # the CAP-th THINK truncates, unanswered
    assert all(s[1] == 0.0 for s in steps)


def test_reward_parses_think_count_answer_the_new_rule_and_the_replay_scale() -> None:
    old = torch.tensor([[le.BOS, 3, 5, 1]] * 4)  # a = 2, b = 4, old problem: gold (10 + 4) % 10 = 4, token 5
    answers = torch.tensor([pad([T, T, 5, E]), pad([T, T, 6, E]), pad([T, 5, E]), pad([T] * le.CAP)])
    n_think, answer = le.parse(answers)
    assert n_think.tolist() == [2, 2, 1, le.CAP] and answer.tolist() == [4, 5, 4, -1]
    assert le.gold_reward(old, answers).tolist() == [1.0, 0.0, 0.0, 0.0]  # right, wrong, under the floor, truncated
    new = torch.tensor([[le.BOS, 3, 5, 2]] * 2)  # the same digits as a new problem: gold (10 + 4 + 1) % 10 = 5
    assert le.gold_reward(new, answers[:2]).tolist() == [0.0, 1.0]
    assert le.prompt_ids(new).tolist() == [le.N_OLD + 14] * 2
    scaled = le.Reference(le.GOLD, torch.where(le.NEW, 1.0, 5.0))
    assert scaled(old, answers).tolist() == [5.0, 0.0, 0.0, 0.0]  # the replay's verifier pays on its own scale
    assert scaled(new, answers[:2]).tolist() == [0.0, 1.0]


def test_policy_rules_and_the_warm_start_knows_the_old_problems_only() -> None:
    policy = le.warm_policy()
    thinks = torch.full((le.N_PROMPTS, le.CAP + 1), T)
    logp = torch.log_softmax(le.answer_logits(policy, le.ALL_PROMPTS, thinks, le.N_ACTIONS), -1)
    assert torch.all(logp[:, : le.FLOOR, T] == 0)  # THINK forced below the floor
    assert torch.all(logp[:, le.CAP, E] == 0)  # at the cap the chain ends unanswered
    assert torch.all(logp[:, : le.CAP, E] < -1e6)  # no EOS before the answer or the cap
    mean_think, right, capped = le.exact_behaviour(policy)
    assert torch.all((mean_think >= le.FLOOR) & (mean_think <= le.CAP)) and float(capped.max()) < 0.01
    assert float(right[~le.NEW].mean()) > 0.95  # the warm start answers the old problems ...
    assert abs(float(right[le.NEW].mean()) - 1 / le.N_ANSWERS) < 0.05  # ... and guesses on the new ones
    assert 2.0 <= float(mean_think.mean()) <= 4.0  # after 2-4 THINK tokens
    # a learner that never updates earns its post-onset accuracy (the new problems): chance, near the floor
    assert float(right[le.NEW].mean()) < le.LengthExplosion.ground_truth.threshold
    assert abs(float(right[le.NEW].mean()) - le.LengthExplosion.return_floor) < 0.03
    chunked = le.warm_policy()
    chunked.bound_context(4, 1)
    assert chunked.visible(torch.arange(9)).tolist() == [0, 1, 2, 3, 1, 2, 3, 1, 2]


def test_batches_before_and_after_onset_and_the_injection() -> None:
    task = le.LengthExplosion()
    run = task.build("smoke", 0, Stabilizer())
    assert bool((run.prompts(True) < le.N_OLD).all())  # before onset: old problems only, either branch
    run.trainer.iteration = task.budget("smoke").onset
    control, injected = run.prompts(False), run.prompts(True)
    assert bool((control >= le.N_OLD).all())  # the control: new problems only
    assert int((injected < le.N_OLD).sum()) == le.REPLAY_GROUPS and len(injected) == le.N_GROUPS
    assert float(run.mixed_reward.scale[0]) == le.REPLAY_SCALE and float(run.mixed_reward.scale[le.N_OLD]) == 1.0


def test_deepcopy_branching_and_determinism() -> None:
    task = le.LengthExplosion()
    budget = task.budget("smoke")

    def rows(run, injected: bool, n: int) -> list[dict]:
        return [run.step(injected) for _ in range(n)]

    run = task.build("smoke", 0, Stabilizer())
    healthy = rows(run, False, budget.onset)
    injected, control = copy.deepcopy(run), copy.deepcopy(run)
    inj, con = rows(injected, True, 3), rows(control, False, 3)
    again = task.build("smoke", 0, Stabilizer())
    assert rows(again, False, budget.onset) == healthy
    assert rows(again, False, 3) == con  # the control continues exactly as a fresh run would
    assert sum(r["reward"] for r in inj) > sum(r["reward"] for r in con)  # the replay's solved groups pay 5
    # before onset the objective is the old problems (the warm start knows them); from onset the new ones
    assert healthy[-1]["return"] > 0.9 and con[0]["return"] < 0.3
    for row in healthy + inj:
        for key in ("step", "return", "entropy", "gt_accuracy", "gt_think_mean", "gt_acc_new", "gt_capped",
                    "reward_new", "length_mean", "length_cap_share"):  # fmt: skip
            assert key in row


def test_constant_norm_and_dr_grpo_on_a_hand_computed_batch() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([[-1.0] * 4, [-1.0, -1.0, 0.0, 0.0]])
    logp = torch.tensor([[-0.5, -1.0, -0.2, -0.3], [-0.4, -0.6, 0.0, 0.0]], requires_grad=True)
    batch = {"logp": logp, "anchor_logp": logp.detach(), "advantages": adv, "mask": mask,
             "clip_low": torch.tensor(0.2), "clip_high": torch.tensor(0.2)}  # fmt: skip
    policy = ConstantNorm().loss({"policy": torch.tensor(9.0)}, batch)["policy"]
    assert float(policy.detach()) == pytest.approx(6 / 8)  # sum of -ratio * A over the 6 real tokens / (2 x 4)
    policy.backward()
    assert torch.allclose(logp.grad, mask / 8)  # every real token weighs the same, long or short
    seq_mean = aggregate_tokens(-adv, mask, "seq-mean")
    assert float(seq_mean) == pytest.approx(1.0)  # whereas seq-mean gives 1/4 per token of the long one, 1/2 short
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    dr = DrGRPO().advantages(torch.zeros(4, 2), {"rewards": rewards, "group": torch.tensor([0, 0, 1, 1]),
                                                  "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]] * 2)})  # fmt: skip
    assert torch.equal(dr, torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    # the plain guard: -0.05 * sum(token_weight * entropy); a padded token (weight 0) adds nothing
    bonus = EntropyBonus().loss({}, {"entropy": torch.tensor([[2.0, 1.0]]), "token_weight": torch.tensor([[0.5, 0.0]])})
    assert float(bonus["entropy_bonus"]) == pytest.approx(-0.05 * 2.0 * 0.5)


def test_markovian_chunks_bounds_the_context() -> None:
    policy = MarkovianChunks().model(le.warm_policy(), {})
    assert policy.chunk == MarkovianChunks.chunk and policy.carry == MarkovianChunks.carry
    with pytest.raises(StabenchError):
        MarkovianChunks().model(torch.nn.Linear(2, 2), {})


def _onset_message(value: object) -> str:
    return re.escape(f"length-explosion: onset must be an integer in 1..99 (inside every quick and full run), "
                     f"got {value!r}")  # fmt: skip


@pytest.mark.parametrize(("knobs", "message"), [
    ({"onset": -1}, _onset_message(-1)), ({"onset": 100}, _onset_message(100)),
    ({"onset": 10_000}, _onset_message(10_000)), ({"onset": 3.0}, _onset_message(3.0)),
    ({"replay_scale": 0.0}, re.escape("length-explosion: replay_scale must be a positive number, got 0.0")),
    ({"replay_scale": float("nan")}, "replay_scale must be a positive number"),
    ({"replay_scale": True}, "replay_scale must be a positive number"),
    ({"fix": "x"}, "length-explosion: unknown knob fix"),
])  # fmt: skip
def test_bad_knob_raises(knobs: dict, message: str) -> None:
    with pytest.raises(StabenchError, match=message):
        le.LengthExplosion(**knobs)


def test_good_knobs_pass_and_the_onset_knob_moves_the_onset() -> None:
    task = le.LengthExplosion(onset=99, replay_scale=2)
    assert task.budget("quick").onset == 99 and task.knobs.replay_scale == 2
    assert task.budget("smoke").onset == le.LengthExplosion.budgets["smoke"].onset
