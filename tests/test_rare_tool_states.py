"""rare-tool-states: the tool environment, the sampler mismatch, exact returns, branching, the turn-level fix, knobs."""

from __future__ import annotations

import copy
import math

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.clipping import DualClip
from stabench.baselines.stabilizers.importance import TokenTIS, TurnLevelIS, turn_mean, turn_size
from stabench.baselines.tool_ppo import ToolPPO, ToolPPOConfig
from stabench.suite.api import StabenchError, Stabilizer
from stabench.suite.registry import resolve_class
from stabench.tasks import rare_tool_states as task_module
from stabench.tasks.rare_tool_states import (
    ENV_ID,
    RESULTS,
    RareToolStates,
    ShiftedFormatWorld,
    exact_returns,
    warm_policy,
)
from stabench.tasks.worlds import tools

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)


def same_rows(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all((math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a)


@pytest.mark.parametrize("rare_prob", [0.0, 1.0])
def test_env_passes_check_env_and_pays_for_the_decoded_result(rare_prob: float) -> None:
    env = gym.make(ENV_ID, rare_prob=rare_prob)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=3)
    query = int(obs[0])
    obs, reward, done, _, info = env.step(query)  # the right call: the tool replies into the observation
    truth = RESULTS[query]
    reply = torch.from_numpy(obs[list(tools.REPLY_SLOTS)])
    assert info["tool_state"] == (rare_prob == 1.0)
    assert torch.equal(reply, (truth + 1) % tools.N_DIGITS if rare_prob else truth)
    assert obs[tools.FLAG_SLOT] == (task_module.ALT if rare_prob else tools.OK)
    rewards = [env.step(int(d))[1] for d in truth]  # answer the result in the usual format
    assert rewards[:2] == [0.0, 0.0] and rewards[2] == pytest.approx(1.0)
    env.reset(seed=3)
    env.step(query)
    copied = [env.step(int(d))[1] for d in reply][-1]  # copying a shifted reply is wrong on every digit
    assert copied == pytest.approx(0.0 if rare_prob else 1.0)


def test_sampler_mismatch_only_on_tool_state_tokens() -> None:
    policy = warm_policy()
    config = ToolPPOConfig(n_groups=64, group_size=4, tool_temperature=3.0)
    trainer = ToolPPO(policy, ShiftedFormatWorld(), config, Stabilizer())
    batch = trainer.rollout(rare_prob=0.5)
    with torch.no_grad():
        logp = torch.log_softmax(policy(batch["inputs"]), -1).gather(-1, batch["actions"][..., None]).squeeze(-1)
    tool = batch["tool_mask"]
    alt = batch["ctx"][:, tools.FLAG_SLOT] == task_module.ALT
    assert torch.equal(tool, alt[:, None] & torch.tensor([False, True, True, True]))
    assert 0 < tool.any(1).float().mean() < 1
    gap = (batch["behaviour_logp"] - logp).abs()
    assert float(gap[~tool].max()) < 1e-5  # text tokens: the sampler is the policy
    assert float(gap[tool].mean()) > 0.05  # tool-state tokens: the sampler's temperature differs


def test_exact_returns_match_monte_carlo() -> None:
    policy = warm_policy()
    usual, rare = exact_returns(policy)
    assert usual > 0.9 and rare < 0.4  # the warm start knows the usual format only
    config = ToolPPOConfig(n_groups=500, group_size=4, tool_temperature=1.0)
    for prob, exact in ((0.0, usual), (1.0, rare)):
        batch = ToolPPO(policy, ShiftedFormatWorld(), config, Stabilizer()).rollout(rare_prob=prob)
        assert float(batch["rewards"].mean()) == pytest.approx(exact, abs=0.03)


def test_branching_and_determinism() -> None:
    task = RareToolStates()
    run = task.build("smoke", 0, Stabilizer())
    healthy = [run.step(True) for _ in range(task.budget("smoke").onset)]
    injected, control = copy.deepcopy(run), copy.deepcopy(run)
    rows_i = [injected.step(True) for _ in range(2)]
    rows_c = [control.step(False) for _ in range(2)]
    # version 2: the rare format becomes common in BOTH branches; only the injected sampler is mismatched
    assert healthy[0]["rare_share"] == task_module.RARE_BEFORE
    assert rows_i[0]["rare_share"] == rows_c[0]["rare_share"] == task_module.RARE_AFTER
    assert injected.trainer.config.tool_temperature == task_module.TOOL_TEMPERATURE
    assert control.trainer.config.tool_temperature == 1.0 == run.trainer.config.tool_temperature
    assert not same_rows(rows_i[0], rows_c[0])
    again = task.build("smoke", 0, Stabilizer())
    assert all(same_rows(a, again.step(True)) for a in healthy)
    for key in ("step", "return", "entropy", "ratio_p99_tool", "ratio_ess_text"):
        assert key in rows_i[0]


def _batch(logp: torch.Tensor, old: torch.Tensor, behaviour: torch.Tensor, adv: torch.Tensor) -> dict:
    mask = torch.ones_like(logp)
    return {"logp": logp, "old_logp": old, "behaviour_logp": behaviour, "anchor_logp": behaviour,
            "advantages": adv, "mask": mask,
            "turn": torch.tensor([[0, 1, 1, 1]]), "token_weight": mask / mask.sum(),
            "clip_low": torch.tensor(0.2), "clip_high": torch.tensor(0.2)}


def test_turn_mean_broadcasts_per_turn() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0, 7.0]])
    out = turn_mean(values, torch.tensor([[0, 1, 1, 1]]), torch.ones(1, 4))
    assert torch.allclose(out, torch.tensor([[1.0, 4.0, 4.0, 4.0]]))
    assert torch.equal(turn_size(torch.tensor([[0, 1, 1, 1]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])),
                       torch.tensor([[1.0, 2.0, 2.0, 0.0]]))


def test_turn_level_is_formula() -> None:
    # Token log-ratios vs pi_old: 0.1, 0.3, 0.6, 0.0. Log-weights log(pi_old / q): 0.5 | -0.2, 0.3, 0.1.
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    logp = old + torch.tensor([[0.1, 0.3, 0.6, 0.0]])
    behaviour = old - torch.tensor([[0.5, -0.2, 0.3, 0.1]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    batch = _batch(logp, old, behaviour, adv)
    rho = [math.exp(v) for v in (0.1, 0.3, 0.6, 0.0)]
    bias = ((rho[1] - 1.2) + (rho[2] - 1.2)) / 4  # clipping bias: triggered on tokens 1 and 2
    # Product weights: turn 0 min(e^0.5, 2) = e^0.5; turn 1 min(e^(-0.2 + 0.3 + 0.1), 2) = e^0.2.
    expected = (math.exp(0.5) * rho[0] + math.exp(0.2) * (rho[1] + rho[2] + rho[3])) / 4 / (1 + bias)
    assert float(TurnLevelIS().loss({}, batch)["policy"]) == pytest.approx(expected, rel=1e-6)
    geometric = TurnLevelIS()
    geometric.geometric = True  # turn 1's weight is exp(mean(-0.2, 0.3, 0.1)) = exp(0.2 / 3)
    expected = (math.exp(0.5) * rho[0] + math.exp(0.2 / 3) * (rho[1] + rho[2] + rho[3])) / 4 / (1 + bias)
    assert float(geometric.loss({}, batch)["policy"]) == pytest.approx(expected, rel=1e-6)
    turn = TurnLevelIS()
    turn.turn_ratio = True  # turn 1's ratio is exp(mean(0.3, 0.6, 0.0)) = exp(0.3) on all three tokens
    r1 = math.exp(0.3)
    expected = (math.exp(0.5) * rho[0] + math.exp(0.2) * 3 * r1) / 4 / (1 + 3 * (r1 - 1.2) / 4)
    assert float(turn.loss({}, batch)["policy"]) == pytest.approx(expected, rel=1e-6)
    calm = _batch(old.clone(), old, old, adv)  # on-policy, no clipping: plain token mean of -A
    assert float(TurnLevelIS().loss({}, calm)["policy"]) == pytest.approx(1.0)


def test_token_tis_and_dual_clip_formulas() -> None:
    old = torch.zeros(1, 4)
    logp = torch.tensor([[0.0, math.log(5.0), 0.0, 0.0]])
    behaviour = torch.tensor([[0.0, 0.0, -math.log(4.0), 0.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    batch = _batch(logp, old, behaviour, adv)
    tis = float(TokenTIS().loss({}, batch)["policy"])
    # token ratios vs pi_old: 1, 5, 1, 1; weights min(pi_old / q, 2): 1, 1, 2, 1.
    assert tis == pytest.approx((1.0 + 5.0 - 2.0 - 1.0) / 4)
    dual = float(DualClip().loss({}, batch)["policy"])
    # ratios vs the sampler: 1, 5 (A < 0: 5 capped at c = 3), 4 (A > 0: clipped to 1.2), 1.
    assert dual == pytest.approx((1.0 + 3.0 - 1.2 - 1.0) / 4)
    baseline_like = DualClip()
    baseline_like.c = math.inf
    assert float(baseline_like.loss({}, batch)["policy"]) == pytest.approx((1.0 + 5.0 - 1.2 - 1.0) / 4)


@pytest.mark.parametrize("knobs", [{"rare_after": 1.5}, {"tool_temperature": 0.0}, {"lag": 3}])
def test_bad_knobs_raise(knobs: dict) -> None:
    with pytest.raises(StabenchError, match=next(iter(knobs))):
        RareToolStates(**knobs)


@pytest.mark.parametrize("onset", [-1, 0, 180, 10_000, 2.5, True])
def test_bad_onset_raises(onset: object) -> None:
    message = f"rare-tool-states: onset must be an integer in 1..179 (inside every quick and full run), got {onset!r}"
    with pytest.raises(StabenchError) as raised:
        RareToolStates(onset=onset)
    assert str(raised.value) == message


def test_onset_knob_moves_the_switch() -> None:
    task = RareToolStates(onset=3)
    assert task.budget("quick").onset == 3 and task.budget("smoke").onset == 2
    run = task.build("quick", 0, Stabilizer())
    shares = [run.step(True)["rare_share"] for _ in range(5)]
    assert shares == [task_module.RARE_BEFORE] * 3 + [task_module.RARE_AFTER] * 2


def test_exact_sampler_outside_the_injection_and_a_non_learner_fails() -> None:
    """Before onset and in the control the sampler is the policy (behaviour log-probs = the policy's); after
    onset the warm policy, which does not know the rare format, scores below the ground truth's threshold."""
    task = RareToolStates()
    run = task.build("smoke", 0, Stabilizer())
    batch = run.trainer.rollout(rare_prob=1.0)
    with torch.no_grad():
        logp = torch.log_softmax(run.trainer.policy(batch["inputs"]).double(), -1)
    own = logp.gather(-1, batch["actions"][..., None]).squeeze(-1).float()
    assert batch["tool_mask"].any() and torch.allclose(own, batch["behaviour_logp"], atol=1e-5)
    usual, rare = exact_returns(warm_policy())
    frozen = (1 - task_module.RARE_AFTER) * usual + task_module.RARE_AFTER * rare
    assert frozen < task.ground_truth.threshold
    assert task.return_floor < task.ground_truth.threshold


def test_version_4_budget_matched_fix_and_anchors() -> None:
    """Version 4: 160 post-onset iterations at quick (version 3 had 100; same onset), token-level truncated IS as
    the matched fix (turn-is a variant), the failure tail is iterations 135-179, the full tier's post-onset phase
    is no shorter, and the control's reach clears the ground truth's bar."""
    task = RareToolStates()
    quick = task.budget("quick")
    assert (quick.iterations, quick.onset) == (180, 20) and task.version == "4"
    full = task.budget("full")
    assert full.iterations - full.onset >= quick.iterations - quick.onset
    assert task.matched_fix == "token-tis" and task.role("token-tis") == "matched-fix"
    assert task.role("turn-is") == "other" and "turn-is" in task.methods
    assert resolve_class("stabilizer", task.matched_fix) is TokenTIS
    tail = math.ceil(task.ground_truth.tail * quick.iterations)
    assert quick.iterations - tail == 135
    assert task.return_floor < task.ground_truth.threshold < task.return_ceiling <= 1.0
    assert task.normalized_return(task.return_floor) == 0.0
