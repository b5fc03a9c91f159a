"""moe-routing: environment, rewards, the MoE policy's engine mode and route replay, the diagnostics on
constructed cases, exact held-out evaluation, branching, knobs, the routing-replay stabilizers."""

from __future__ import annotations

import copy
import math
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.grpo import GRPO
from stabench.baselines.stabilizers.routing import OldRoutingReplay, RolloutRoutingReplay
from stabench.suite.api import StabenchError, Stabilizer
from stabench.suite.registry import make_stabilizer
from stabench.tasks import moe_routing as mr
from stabench.tasks.worlds import digits

pytestmark = pytest.mark.smoke


def _policy(seed: int = 0) -> mr.TinyMoE:
    torch.manual_seed(seed)
    return mr.tiny_moe().eval()


def _rows(n: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    answers = torch.randint(0, mr.N_ACTIONS, (n, mr.ANSWER_LEN), generator=g)
    return torch.cat([mr.TRAIN_PROMPTS[:n], answers[:, :-1]], 1)


def test_new_rule_also_bans_five_and_no_heldout_prompt_holds_it() -> None:
    prompts = torch.tensor([[mr.BOS, 1, 4]] * 4)
    answers = torch.tensor([[0, 2, 3], [0, 1, 3], [5, 5, 5], [0, 5, 2]])
    assert mr.correct(prompts, answers).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert mr.correct_new(prompts, answers).tolist() == [1.0, 0.0, 0.0, 0.0]
    pairs = digits.HELDOUT_PROMPTS[:, 1:].tolist()
    assert digits.HELDOUT_CORRECT.sum(-1).tolist() == [64.0 if a == b else 27.0 for a, b in pairs]
    assert len(mr.TRAIN_PROMPTS) + len(digits.HELDOUT_PROMPTS) == 36


@pytest.mark.parametrize("after_onset", [False, True])
def test_env_passes_check_env_and_pays_the_trainers_rule(after_onset: bool) -> None:
    env = gym.make("stabench/MoERouting-v0", after_onset=after_onset)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=3)
    prompt = torch.tensor([[mr.BOS, *obs[:2].tolist()]])
    for answer in ([0, 5, 2], [1, 2, 3]):
        env.reset(seed=3)
        rewards = [env.step(t)[1] for t in answer]
        rule = mr.correct_new if after_onset else mr.correct
        assert rewards == [0.0, 0.0, float(rule(prompt, torch.tensor([answer]))[0])]


def test_diagnostics_on_constructed_cases() -> None:
    a = torch.tensor([[[0, 1], [2, 3]], [[1, 0], [3, 2]]])  # 2 x 2 decisions of top-2 expert ids
    b = torch.tensor([[[1, 0], [2, 1]], [[1, 0], [0, 1]]])  # same set, one expert changed, same, both changed
    assert mr.flip_rate(a, a) == 0.0
    assert mr.flip_rate(a, b) == 0.5  # the order inside a set does not count
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.1, 0.3, 0.3]]))
    base = torch.log(torch.tensor([[0.2, 0.3, 0.3], [0.5, 0.3, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # ratios 2.5, 1.67, 3 (masked in), 0.2, 1 (in), 1 (masked out): 3 of 5 beyond [1/2, 2]
    assert mr.extreme_ratio_share(logp, base, mask) == pytest.approx(3 / 5)


def test_engine_with_step_zero_is_bit_identical_and_a_coarse_router_flips_routes() -> None:
    policy, rows = _policy(), _rows()
    with torch.no_grad():
        own = policy(input_ids=rows).logits
        own_routes = policy.chosen_experts()
        same = mr.Engine(policy, 0.0)(rows).logits
        coarse = mr.Engine(policy, mr.ROUTER_STEP)
        flipped = coarse(rows).logits
    assert torch.equal(own, same)
    assert mr.flip_rate(own_routes, coarse.chosen) > 0.05
    assert not torch.equal(own, flipped)
    assert policy.routes.sampling is False  # the engine mode ends with the call


@pytest.mark.parametrize("mode", ["sampler", "old"])
def test_replay_fixes_the_routes_and_keeps_the_router_differentiable(mode: str) -> None:
    policy, rows = _policy(), _rows()
    policy.route_replay = mode
    policy.routes.active = True
    engine = mr.Engine(policy, 1.0)
    with torch.no_grad():
        engine(rows)
        first = policy(input_ids=rows).logits
        first_routes = policy.chosen_experts()
    expected = engine.chosen if mode == "sampler" else first_routes
    assert torch.equal(first_routes, expected)
    with torch.no_grad():  # move every router: unreplayed routes would change
        for layer in policy.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight))
    out = policy(input_ids=rows).logits
    assert torch.equal(policy.chosen_experts(), expected)
    out.sum().backward()
    assert all(float(layer.mlp.gate.weight.grad.abs().sum()) > 0 for layer in policy.model.layers)
    assert not torch.equal(out.detach(), first)
    policy.routes.active = False  # outside an iteration the policy routes itself
    with torch.no_grad():
        policy(input_ids=rows)
    assert not torch.equal(policy.chosen_experts(), expected)


def test_stabilizers_switch_the_mode_and_apply_only_where_provided() -> None:
    policy = _policy()
    assert RolloutRoutingReplay().model(policy, {}).route_replay == "sampler"
    assert OldRoutingReplay().model(policy, {}).route_replay == "old"
    with pytest.raises(ValueError, match="route_replay"):
        policy.route_replay = "new"
    task = mr.MoERouting()
    assert make_stabilizer("routing-replay").applies_to(task)
    assert make_stabilizer("routing-replay-old").applies_to(task)
    from stabench.tasks.entropy_collapse import EntropyCollapse

    assert not make_stabilizer("routing-replay").applies_to(EntropyCollapse())


def test_control_engine_gives_behaviour_logp_equal_to_old_logp() -> None:
    torch.set_num_threads(1)
    policy = mr.warm_policy().train()
    trainer = GRPO(policy, mr.warm_policy(), mr.correct, mr.GRPO_CONFIG, Stabilizer())
    state = trainer.iterate(mr.correct_new, mr.TRAIN_PROMPTS[:8], sampler=mr.Engine(policy, 0.0))
    assert torch.equal(state.batch["behaviour_logp"], state.batch["old_logp"])
    state = trainer.iterate(mr.correct_new, mr.TRAIN_PROMPTS[:8], sampler=mr.Engine(policy, mr.ROUTER_STEP))
    assert not torch.equal(state.batch["behaviour_logp"], state.batch["old_logp"])


def test_heldout_evaluation_is_exact_and_the_warm_start_fails_the_ground_truth() -> None:
    policy = _policy()
    logp = digits.heldout_logp(policy)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(len(digits.HELDOUT_PROMPTS), dtype=torch.float64))
    p, a = digits.HELDOUT_PROMPTS[2], digits.ALL_ANSWERS[77]
    with torch.no_grad():
        lp = torch.log_softmax(mr.answer_logits(policy, p[None], a[None], mr.N_ACTIONS).double(), -1)
    assert float(logp[2, 77]) == pytest.approx(float(lp[0].gather(-1, a[:, None]).sum()), abs=1e-6)
    task = mr.MoERouting()
    warm = mr.heldout_accuracy(mr.warm_policy())
    assert warm < task.ground_truth.threshold
    assert task.return_floor < task.return_ceiling


def test_branching_is_paired_and_deterministic() -> None:
    torch.set_num_threads(1)
    task = mr.MoERouting()
    budget = task.budget("smoke")

    def rows(seed: int, stabilizer: Stabilizer) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
        run = task.build("smoke", seed, stabilizer)
        healthy = [run.step(False) for _ in range(budget.onset)]
        branch = copy.deepcopy(run)
        tail_i = [branch.step(True) for _ in range(budget.iterations - budget.onset)]
        tail_c = [run.step(False) for _ in range(budget.iterations - budget.onset)]
        return healthy + tail_i, healthy + tail_c

    injected, control = rows(0, Stabilizer())
    required = {"step", "return", "entropy", "reward", "flip_engine", "flip_update", "engine_kl",
                "engine_ratio_share", "update_ratio_share", task.ground_truth.metric}
    for row in injected + control:
        assert required <= set(row)
        assert all(math.isfinite(row[k]) for k in required)
    assert injected[: budget.onset] == control[: budget.onset]
    assert all(row["flip_engine"] == 0.0 and row["engine_kl"] == 0.0 for row in control)
    assert all(row["flip_engine"] > 0.0 for row in injected[budget.onset :])
    assert injected[-1]["step"] == budget.iterations * 8 * 8 * 3
    assert rows(0, Stabilizer())[0] == injected
    replayed, _ = rows(0, RolloutRoutingReplay())
    assert replayed[-1] != injected[-1]


@pytest.mark.parametrize("onset", [0, 60, True])
def test_bad_onset_raises(onset: object) -> None:
    want = f"moe-routing: onset must be an integer in 1..49 (inside every quick and full run), got {onset!r}"
    with pytest.raises(StabenchError, match=re.escape(want)):
        mr.MoERouting(onset=onset)


@pytest.mark.parametrize("router_step", [0, -0.5, "0.5"])
def test_bad_router_step_raises(router_step: object) -> None:
    with pytest.raises(StabenchError, match="moe-routing: router_step must be a positive number"):
        mr.MoERouting(router_step=router_step)


def test_good_knobs_and_unknown_knob() -> None:
    task = mr.MoERouting(onset=25, router_step=0.2)
    assert task.budget("quick").onset == 25 and task.knobs.router_step == 0.2
    with pytest.raises(StabenchError, match="unknown knob"):
        mr.MoERouting(fix="replay")
