"""moe-routing: the banned-digit rules and the environment, the MoE policy's engine mode (runner-up routes on
continuation tokens) and route replay, the warm start's expert ownership, the exact evaluation against brute-force
enumeration, the GRPO sampler path, branching, knobs, the routing-replay stabilizers."""

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
from stabench.baselines.stabilizers.routing import OldRoutingReplay, RolloutRoutingReplay
from stabench.suite.api import StabenchError, Stabilizer
from stabench.suite.registry import make_stabilizer
from stabench.tasks import moe_routing as mr
from stabench.tasks.worlds.tokens import all_answers_logp, enumerate_answers, prefix_logp

pytestmark = pytest.mark.smoke


def _policy(seed: int = 0) -> mr.TinyMoE:
    torch.manual_seed(seed)
    return mr.tiny_moe().eval()


def _rows(n: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    answers = torch.randint(0, mr.N_ACTIONS, (n, mr.ANSWER_LEN), generator=g)
    return torch.cat([mr.TRAIN_PROMPTS[:n], answers[:, :-1]], 1)


def test_the_rules_ban_a_plus_b_mod_6_and_pay_the_risky_and_the_safe_path() -> None:
    prompts = torch.tensor([[mr.BOS, 2, 5]]).expand(5, -1)  # c = 7 mod 6 = 1
    answers = torch.tensor([
        [5, 0, 2, 3, 0, 2],  # risky, completed: 1
        [5, 0, 2, 3, 0, 1],  # risky, the banned digit: 0
        [0, 1, 1, 1, 1, 1],  # safe, whatever follows
        [1, 0, 0, 0, 0, 0],  # safe, its first digit banned: still the safe payment
        [2, 5, 5, 5, 5, 5],  # safe; the old rule pays it (2 and 5 are the prompt's digits, not banned)
    ])  # fmt: skip
    assert mr.banned(prompts).tolist() == [1] * 5
    assert mr.risky_rule(prompts, answers).tolist() == pytest.approx([1.0, 0.0, 0.65, 0.65, 0.65])
    assert mr.old_rule(prompts, answers).tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert mr.banned(mr.EVAL_PROMPTS).tolist() == [0, 1, 0, 1, 1, 1, 1]  # the evaluation reads experts 0 and 1


@pytest.mark.parametrize("after_onset", [False, True])
def test_env_passes_check_env_and_pays_the_trainers_rule(after_onset: bool) -> None:
    env = gym.make("stabench/MoERouting-v0", after_onset=after_onset)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=3)
    prompt = torch.tensor([[mr.BOS, *obs[:2].tolist()]])
    for answer in ([5, 0, 2, 3, 4, 1], [1, 2, 3, 4, 0, 0]):
        env.reset(seed=3)
        rewards = [env.step(t)[1] for t in answer]
        rule = mr.risky_rule if after_onset else mr.old_rule
        assert rewards == [0.0] * 5 + [pytest.approx(float(rule(prompt, torch.tensor([answer]))[0]))]


def test_flip_rate_on_constructed_cases() -> None:
    a = torch.tensor([[[0, 1], [2, 3]], [[1, 0], [3, 2]]])  # 2 x 2 decisions of top-2 expert ids
    b = torch.tensor([[[1, 0], [2, 1]], [[1, 0], [0, 1]]])  # same set, one expert changed, same, both changed
    assert mr.flip_rate(a, a) == 0.0
    assert mr.flip_rate(a, b) == 0.5  # the order inside a set does not count


def test_the_engine_flips_only_continuation_routes_below_its_margin() -> None:
    policy, rows = _policy(), _rows()
    with torch.no_grad():
        own = policy(input_ids=rows).logits
        own_routes = policy.chosen_experts()
        same = mr.Engine(policy, 0.0)(rows).logits
        engine = mr.Engine(policy, math.inf)
        flipped = engine(rows).logits
    assert torch.equal(own, same)
    later = slice(mr.PROMPT_LEN, None)
    assert torch.equal(engine.chosen[:, :, : mr.PROMPT_LEN], own_routes[:, :, : mr.PROMPT_LEN])  # prompt and 1st
    assert mr.flip_rate(engine.chosen[:, :, later], own_routes[:, :, later]) == 1.0  # every continuation token
    assert torch.equal(own[:, : mr.PROMPT_LEN], flipped[:, : mr.PROMPT_LEN])  # the first digit is the learner's
    assert not torch.equal(own[:, mr.PROMPT_LEN :], flipped[:, mr.PROMPT_LEN :])
    with torch.no_grad():
        tiny = mr.Engine(policy, 1e-9)
        tiny(rows)
    assert mr.flip_rate(tiny.chosen, own_routes) == 0.0  # no margin is that small
    assert policy.routes.sampling is False and policy.routes.flip_margin == 0.0  # the engine mode ends with the call


@pytest.mark.parametrize("mode", ["sampler", "old"])
def test_replay_fixes_the_routes_and_keeps_the_experts_trainable(mode: str) -> None:
    policy, rows = _policy(), _rows()
    policy.route_replay = mode
    policy.routes.active = True
    engine = mr.Engine(policy, math.inf)
    with torch.no_grad():
        engine(rows)
        policy(input_ids=rows)
        first_routes = policy.chosen_experts()
    expected = engine.chosen if mode == "sampler" else first_routes
    assert torch.equal(first_routes, expected)
    with torch.no_grad():  # move every router: unreplayed routes would change
        for layer in policy.model.layers:
            layer.mlp.gate.weight.add_(10 * torch.randn_like(layer.mlp.gate.weight))
    out = policy(input_ids=rows).logits
    assert torch.equal(policy.chosen_experts(), expected)
    out.sum().backward()
    experts = policy.model.layers[0].mlp.experts
    assert all(float(p.grad.abs().sum()) > 0 for p in experts.parameters())
    policy.routes.active = False  # outside an iteration the policy routes itself
    with torch.no_grad():
        policy(input_ids=rows)
    assert not torch.equal(policy.chosen_experts(), expected)


def test_a_top_2_config_is_refused() -> None:
    config = mr.tiny_moe().config
    config.num_experts_per_tok = 2
    with pytest.raises(ValueError, match="routes top-1"):
        mr.TinyMoE(config)


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


def test_the_warm_start_routes_each_prompt_to_the_expert_of_its_banned_digit_and_a_flip_costs_completion() -> None:
    torch.set_num_threads(1)
    policy = mr.warm_policy().eval()
    with torch.no_grad():
        policy(input_ids=_rows(28))
    routes = policy.chosen_experts()[0, :, mr.PROMPT_LEN - 1 :, 0]  # [rows, the positions that write digits]
    owner = mr.banned(mr.TRAIN_PROMPTS[:28])[:, None].expand_as(routes)
    assert float((routes == owner).double().mean()) > 0.9  # before b is read the router cannot know c
    stats = mr.exact_stats(policy)
    assert stats["gt_completion"] > 0.9 and stats["gt_completion"] - stats["gt_engine_completion"] > 0.3
    assert mr.SAFE_PAY < stats["exact_reward"] < mr.REWARD_FLOOR  # the warm start fails the ground truth
    same = mr.exact_stats(policy, flip_margin=1e-9)
    assert same["gt_engine_completion"] == pytest.approx(same["gt_completion"])
    assert policy.routes.store == {"sampler": {}, "old": {}}  # evaluation leaves no routes to replay


def test_exact_evaluation_equals_brute_force_enumeration() -> None:
    policy = mr.warm_policy().eval()
    everything = enumerate_answers(mr.N_ACTIONS, mr.ANSWER_LEN)  # 46656 answers
    values = []
    for prompt in mr.EVAL_PROMPTS:
        with torch.no_grad():
            lp = all_answers_logp(prefix_logp(policy, prompt, mr.ANSWER_LEN, mr.N_ACTIONS))
        values.append(float((lp.exp() * mr.risky_rule(prompt[None].expand(len(everything), -1), everything)).sum()))
    assert mr.exact_stats(policy)["exact_reward"] == pytest.approx(sum(values) / len(values), abs=1e-5)


def test_grpo_hands_the_engines_log_probs_as_behaviour() -> None:
    torch.set_num_threads(1)
    run = mr.MoERouting().build("smoke", 0, Stabilizer())
    prompts = mr.TRAIN_PROMPTS[:8]
    state = run.iterate(mr.old_rule, prompts, mr.Engine(run.trainer.policy, 0.0))
    assert torch.equal(state.batch["behaviour_logp"], state.batch["old_logp"])
    state = run.iterate(mr.risky_rule, prompts, mr.Engine(run.trainer.policy, math.inf))
    b = state.batch
    assert torch.equal(b["behaviour_logp"][:, 0], b["old_logp"][:, 0])  # the first digit is routed alike
    assert not torch.allclose(b["behaviour_logp"][:, 1:], b["old_logp"][:, 1:])
    assert run.trainer.policy.routes.store == {"sampler": {}, "old": {}} and not run.trainer.policy.routes.active


def test_branching_is_paired_and_deterministic_and_rows_are_evaluated_every_few_iterations() -> None:
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
    required = {"step", "entropy", "reward", "flip_engine", "engine_kl", "grad_norm_total"}
    for row in injected + control:
        assert required <= set(row)
        assert all(math.isfinite(row[k]) for k in required)
    assert injected[: budget.onset] == control[: budget.onset]
    assert all(row["flip_engine"] == 0.0 and row["engine_kl"] == 0.0 for row in control)
    assert all(row["flip_engine"] == 1.0 and row["engine_kl"] != 0.0 for row in injected[budget.onset :])
    for i, row in enumerate(injected, start=1):  # evaluated every EVAL_EVERY iterations and at the last one
        assert math.isfinite(row["exact_reward"]) == (i % mr.EVAL_EVERY == 0 or i == budget.iterations)
    assert injected[-1]["step"] == budget.iterations * 8 * 8 * mr.ANSWER_LEN
    assert rows(0, Stabilizer())[0] == injected
    replayed, _ = rows(0, RolloutRoutingReplay())
    assert replayed[-1] != injected[-1]


def test_the_threshold_lies_between_floor_and_ceiling() -> None:
    assert mr.MoERouting.return_floor < mr.REWARD_FLOOR < mr.MoERouting.return_ceiling


@pytest.mark.parametrize("onset", [0, 60, True])
def test_bad_onset_raises(onset: object) -> None:
    want = f"moe-routing: onset must be an integer in 1..59 (inside every quick and full run), got {onset!r}"
    with pytest.raises(StabenchError, match=re.escape(want)):
        mr.MoERouting(onset=onset)


@pytest.mark.parametrize("flip_margin", [0, -0.5, "0.5", True])
def test_bad_flip_margin_raises(flip_margin: object) -> None:
    with pytest.raises(StabenchError, match="moe-routing: flip_margin must be a positive number"):
        mr.MoERouting(flip_margin=flip_margin)


def test_good_knobs_and_unknown_knob() -> None:
    task = mr.MoERouting(onset=25, flip_margin=6.0)
    assert task.budget("quick").onset == 25 and task.knobs.flip_margin == 6.0
    with pytest.raises(StabenchError, match="unknown knob"):
        mr.MoERouting(fix="replay")
