"""tool-recovery: the timeout environment, exact returns, branching, split diagnostics, the state-grouped fix, knobs."""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.tool_states import ToolStateGroups, subgroup_advantages
from stabench.baselines.tool_ppo import ToolPPO, ToolPPOConfig
from stabench.suite.api import StabenchError, Stabilizer
from stabench.suite.registry import resolve_class
from stabench.tasks import tool_recovery as task_module
from stabench.tasks.tool_recovery import (
    ENV_ID,
    RESULTS,
    TimeoutWorld,
    ToolRecovery,
    exact_returns,
    split_means,
    warm_policy,
)
from stabench.tasks.worlds import tools

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)


def same_rows(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all((math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a)


@pytest.mark.parametrize("timeout_prob", [0.0, 1.0])
def test_env_passes_check_env_and_pays_the_recovery(timeout_prob: float) -> None:
    env = gym.make(ENV_ID, timeout_prob=timeout_prob, timeout_pay=0.5)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=3)
    query = int(obs[0])
    obs, _, _, _, info = env.step(query)
    truth = RESULTS[query]
    assert info["tool_state"] == (timeout_prob == 1.0)
    reply = obs[list(tools.REPLY_SLOTS)]
    if timeout_prob:
        assert obs[tools.FLAG_SLOT] == task_module.ERR and (reply == task_module.ERR).all()
    else:
        assert obs[tools.FLAG_SLOT] == tools.OK and torch.equal(torch.from_numpy(reply), truth)
    rewards = [env.step(int(d))[1] for d in truth]  # the right answer, from the reply or from the query alone
    assert rewards[:2] == [0.0, 0.0] and rewards[2] == pytest.approx(0.5 if timeout_prob else 1.0)


def test_exact_returns_match_monte_carlo_and_the_warm_start_cannot_recover() -> None:
    policy = warm_policy()
    usual, timeout = exact_returns(policy)
    assert usual > 0.9 and 1 / tools.N_DIGITS < timeout < 0.3  # a slight lean towards the recovery, far from it
    config = ToolPPOConfig(n_groups=500, group_size=4)
    for prob, exact in ((0.0, usual), (1.0, timeout)):
        batch = ToolPPO(policy, TimeoutWorld(), config, Stabilizer()).rollout(rare_prob=prob)
        assert float(batch["rewards"].mean()) == pytest.approx(exact, abs=0.03)
        assert bool(batch["tool_mask"].any()) == (prob == 1.0)


def test_branching_pay_and_determinism() -> None:
    task = ToolRecovery()
    run = task.build("smoke", 0, Stabilizer())
    healthy = [run.step(True) for _ in range(task.budget("smoke").onset)]
    injected, control = copy.deepcopy(run), copy.deepcopy(run)
    rows_i = [injected.step(True) for _ in range(2)]
    rows_c = [control.step(False) for _ in range(2)]
    assert healthy[0]["timeout_share"] == task_module.TIMEOUT_BEFORE
    assert rows_i[0]["timeout_share"] == rows_c[0]["timeout_share"] == task_module.TIMEOUT_AFTER
    assert injected.trainer.world.timeout_pay == task_module.TIMEOUT_PAY
    assert control.trainer.world.timeout_pay == 1.0 == run.trainer.world.timeout_pay
    assert injected.trainer.config.tool_temperature == 1.0  # no sampling mismatch: not rare-tool-states
    assert rows_i[0]["reward"] < rows_c[0]["reward"]
    again = task.build("smoke", 0, Stabilizer())
    assert all(same_rows(a, again.step(True)) for a in healthy)
    for key in (
        "return",
        "entropy_tool",
        "entropy_text",
        "adv_abs_tool",
        "adv_abs_text",
        "ratio_p99_tool",
        "ratio_ess_text",
    ):
        assert key in rows_i[0]


def test_split_means_on_a_constructed_case() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    tool = torch.tensor([[False, True, True, True], [False, False, False, False]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    everything, on_tool, on_text = split_means(values, tool, mask)
    assert everything == pytest.approx((1 + 2 + 3 + 5 + 6 + 7 + 8) / 7)
    assert on_tool == pytest.approx(2.5) and on_text == pytest.approx((1 + 5 + 6 + 7 + 8) / 5)
    assert math.isnan(split_means(values, torch.zeros_like(tool), mask)[1])


def test_subgroup_advantages_restore_the_compressed_signal() -> None:
    # One group: 3 usual episodes paid ~1, 5 timed-out ones paid 0.1 x their right share.
    rewards = torch.tensor([1.0, 1.0, 2 / 3, 0.1, 0.0, 0.0, 0.1 / 3, 0.0])
    tool = torch.tensor([False, False, False, True, True, True, True, True])
    group = torch.zeros(8, dtype=torch.long)
    pooled = (rewards - rewards.mean()) / rewards.std(unbiased=False)
    # the trainer's group advantage: every timed-out episode strongly negative, right or wrong
    assert (pooled[tool] < -0.5).all() and float(pooled[4] - pooled[3]) > -0.3
    adv = subgroup_advantages(rewards, group, tool)
    sub = rewards[tool]
    assert torch.allclose(adv[tool], (sub - sub.mean()) / (sub.std(unbiased=False) + 1e-4))
    assert float(adv[3]) > 1.5 and float(adv[4]) < 0  # the right recovery now stands out
    assert float(adv[tool].mean()) == pytest.approx(0.0, abs=1e-6)
    lone = subgroup_advantages(
        torch.tensor([0.3, 1.0, 0.0]), torch.tensor([0, 0, 0]), torch.tensor([True, False, False])
    )
    assert float(lone[0]) == 0.0 and float(lone[1]) == pytest.approx(1.0, abs=1e-3)


def test_the_stabilizer_broadcasts_to_tokens_and_reads_the_tool_mask() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.1, 0.0])
    tool = torch.tensor([[False] * 4, [False] * 4, [False, True, True, True], [False, True, True, True]])
    mask = torch.ones(4, 4)
    batch = {"rewards": rewards, "group": torch.zeros(4, dtype=torch.long), "tool_mask": tool, "mask": mask}
    out = ToolStateGroups().advantages(torch.zeros(4, 4), batch)
    assert out.shape == (4, 4)
    assert torch.allclose(out[:, 0], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=3e-3)  # eps = 1e-4 in the std
    assert torch.equal(out, out[:, :1].expand(4, 4))
    task = ToolRecovery()
    assert ToolStateGroups().applies_to(task) and resolve_class("stabilizer", task.matched_fix) is ToolStateGroups


@pytest.mark.parametrize("knobs", [{"timeout_after": 1.5}, {"timeout_pay": -0.1}, {"lag": 3}])
def test_bad_knobs_raise(knobs: dict) -> None:
    with pytest.raises(StabenchError, match=next(iter(knobs))):
        ToolRecovery(**knobs)


def test_onset_knob_moves_the_switch() -> None:
    task = ToolRecovery(onset=3)
    run = task.build("quick", 0, Stabilizer())
    shares = [run.step(True)["timeout_share"] for _ in range(5)]
    assert shares == [task_module.TIMEOUT_BEFORE] * 3 + [task_module.TIMEOUT_AFTER] * 2


def test_a_non_learner_fails_and_the_anchors_are_ordered() -> None:
    task = ToolRecovery()
    usual, timeout = exact_returns(warm_policy())
    frozen = (1 - task_module.TIMEOUT_AFTER) * usual + task_module.TIMEOUT_AFTER * timeout
    assert frozen < task.ground_truth.threshold
    assert task.return_floor < task.ground_truth.threshold < task.return_ceiling <= 1.0
    assert task.family == "tools" and task.matched_fix == "tool-state-groups"
