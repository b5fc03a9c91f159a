"""inference-mismatch: the engine-gap diagnostics on constructed cases, the continuation sampler, GRPO's sampler
path (behaviour vs anchor log-probs), the sequence-level IS formula, the risky/safe rule, the exact tree-walk
evaluation against brute-force enumeration, and the branching of a run."""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gymnasium as gym
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.stabilizers.importance import SequenceTIS, TokenTIS
from stabench.suite.api import StabenchError, Stabilizer
from stabench.suite.diagnostics import engine_gap
from stabench.tasks import inference_mismatch as im
from stabench.tasks.worlds import digits
from stabench.tasks.worlds.tokens import all_answers_logp, answer_logits, enumerate_answers, prefix_logp

pytestmark = pytest.mark.smoke


def test_engine_gap_is_zero_when_the_learner_samples() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    gap = engine_gap(logp, logp.clone(), torch.ones(1, 3))
    assert gap == {"engine_kl": 0.0, "engine_k3": 0.0, "engine_chi2": 0.0, "engine_prob_diff_max": 0.0,
                   "engine_low_ratio": 0.0}  # fmt: skip


def test_engine_gap_on_a_hand_computed_case() -> None:
    mu = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.3]]))
    pi = torch.log(torch.tensor([[0.25, 0.5, 0.0005, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding: ignored
    d = [math.log(0.5), math.log(2.0), math.log(0.005)]
    gap = engine_gap(mu, pi, mask)
    assert gap["engine_kl"] == pytest.approx(sum(-x for x in d) / 3)
    assert gap["engine_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert gap["engine_chi2"] == pytest.approx(sum(math.exp(2 * x) for x in d) / 3 - 1)
    assert gap["engine_prob_diff_max"] == pytest.approx(0.25)
    assert gap["engine_low_ratio"] == pytest.approx(1 / 3)


def test_the_rule_pays_the_risky_and_the_safe_path() -> None:
    prompts = torch.tensor([[digits.BOS, 1, 4]]).expand(4, -1)
    answers = torch.tensor([
        [5, 0, 2, 3, 0, 2],  # risky, completed: 1
        [5, 0, 2, 3, 0, 4],  # risky, a banned digit: 0
        [0, 1, 1, 1, 1, 1],  # safe, whatever follows
        [2, 0, 0, 0, 0, 0],  # safe
    ])  # fmt: skip
    assert im.risky_rule(prompts, answers, 0.65).tolist() == pytest.approx([1.0, 0.0, 0.65, 0.65])
    assert im.old_rule(prompts, answers).tolist() == [1.0, 0.0, 0.0, 1.0]


def test_the_sampler_tempers_only_the_continuation_and_follows_the_learner() -> None:
    policy = im.warm_policy()
    sampler = im.ContinuationSampler(policy, temperature=3.0)
    ids = torch.tensor([[digits.BOS, 1, 4, 5, 0, 2]])
    with torch.no_grad():
        z = policy(input_ids=ids).logits[..., : im.N_ACTIONS]
        mu = sampler(input_ids=ids).logits
    assert torch.allclose(mu[0, : im.PROMPT_LEN, : im.N_ACTIONS], z[0, : im.PROMPT_LEN])  # the first digit
    assert torch.allclose(mu[0, im.PROMPT_LEN :, : im.N_ACTIONS], z[0, im.PROMPT_LEN :] / 3.0)  # digits 2-6
    assert (mu[..., im.N_ACTIONS] < -1e3).all()  # never the special token
    assert list(sampler.parameters()) == []  # shares the learner's weights, owns none
    with torch.no_grad():
        policy.lm_head.weight.mul_(3.0)
        assert not torch.allclose(sampler(input_ids=ids).logits, mu)


def test_exact_evaluation_equals_brute_force_enumeration() -> None:
    policy = im.warm_policy()
    stats = im.heldout_stats(policy, temperature=3.0, safe=0.65)
    everything = enumerate_answers(im.N_ACTIONS, im.ANSWER_LEN)  # 46656 answers
    values = []
    for i in (0, 3):  # (0, 1) and (2, 2): four and five allowed digits
        prompt = im.HELDOUT_PROMPTS[i]
        with torch.no_grad():
            lp = all_answers_logp(prefix_logp(policy, prompt, im.ANSWER_LEN, im.N_ACTIONS))
        values.append(
            float((lp.exp() * im.risky_rule(prompt[None].expand(len(everything), -1), everything, 0.65)).sum())
        )
    per_prompt = [im.heldout_stats_per_prompt(policy, 3.0, 0.65)[i]["heldout_reward"] for i in (0, 3)]
    assert per_prompt == pytest.approx(values, abs=1e-6)  # float32 forwards of different batches
    assert 0.65 < stats["heldout_reward"] < 1
    assert stats["gt_engine_completion"] < stats["gt_completion"]  # the tempered continuation completes worse
    same = im.heldout_stats(policy, temperature=1.0, safe=0.65)
    assert same["gt_engine_completion"] == pytest.approx(same["gt_completion"])


def test_grpo_hands_the_sampler_log_probs_as_behaviour_and_anchors_on_the_learner() -> None:
    run = im.InferenceMismatch().build("smoke", 0, Stabilizer())
    trainer = run.trainer
    prompts = im.TRAIN_PROMPTS[:8]
    own = trainer.iterate(im.old_rule, prompts)
    assert own.batch["answers"].shape[1] == im.ANSWER_LEN
    assert torch.equal(own.batch["behaviour_logp"], own.batch["old_logp"])
    sampler = im.ContinuationSampler(trainer.policy)
    state = trainer.iterate(im.risky_rule, prompts, sampler=sampler)
    b = state.batch
    assert torch.equal(b["anchor_logp"], b["old_logp"])
    assert torch.allclose(b["behaviour_logp"][:, 0], b["old_logp"][:, 0], atol=1e-5)  # the first digit agrees
    assert not torch.allclose(b["behaviour_logp"][:, 1:], b["old_logp"][:, 1:])
    with torch.no_grad():
        mu = torch.log_softmax(answer_logits(sampler, b["prompts"], b["answers"], im.N_ACTIONS), -1)
    assert torch.allclose(b["behaviour_logp"], mu.gather(-1, b["answers"][..., None]).squeeze(-1), atol=0.5)


def test_seq_tis_weighs_the_first_token_by_the_continuation_and_token_tis_does_not() -> None:
    old = torch.log(torch.tensor([[0.5, 0.9], [0.5, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.3], [0.5, 0.9]]))  # the first token agrees; the second does not
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    batch = {"logp": logp, "old_logp": old, "behaviour_logp": behaviour, "anchor_logp": old, "advantages": adv,
             "mask": mask, "token_weight": mask / 4, "clip_low": torch.tensor(0.2),
             "clip_high": torch.tensor(0.2)}  # fmt: skip
    seq = SequenceTIS().loss({"policy": torch.tensor(0.0)}, batch)["policy"]
    assert float(seq) == pytest.approx((-2 * 2 + 2 * 1) / 4)  # the first answer's sequence ratio 3, cut at 2
    tok = TokenTIS().loss({"policy": torch.tensor(0.0)}, batch)["policy"]
    assert float(tok) == pytest.approx((-1 - 2 + 1 + 1) / 4)  # the first token keeps weight 1


def test_environment_passes_check_env_and_pays_the_rule_in_force() -> None:
    env = gym.make("stabench/InferenceMismatch-v0").unwrapped
    check_env(env, skip_render_check=True)
    for after_onset, want in ((False, 0.0), (True, im.SAFE_PAY)):
        env = im.InferenceMismatchEnv(after_onset=after_onset)
        env.reset(seed=0)
        env.prompt = torch.tensor([[im.N_ACTIONS, 1, 4]])  # (a, b) = (1, 4)
        rewards = [env.step(x)[1] for x in (0, 1, 1, 1, 1, 1)]  # the safe path, digits equal to a
        assert rewards[:5] == [0.0] * 5 and rewards[5] == pytest.approx(want)


def test_branches_differ_only_in_the_sampler_and_rows_are_evaluated_every_few_iterations() -> None:
    task = im.InferenceMismatch()
    run = task.build("smoke", 0, Stabilizer())
    onset = task.budget("smoke").onset
    for _ in range(onset):
        healthy = run.step(injected=False)
    assert healthy["engine_kl"] == 0.0
    row_i = copy.deepcopy(run).step(injected=True)
    row_c = copy.deepcopy(run).step(injected=False)
    assert row_i["engine_kl"] > 0 and row_c["engine_kl"] == 0.0
    assert row_i["step"] == row_c["step"]
    assert {"return", "entropy", "heldout_reward", "gt_risky_share", "engine_low_ratio"} <= set(row_i)
    evaluated = (onset + 1) % im.EVAL_EVERY == 0
    assert math.isnan(row_i["return"]) != evaluated
    last = copy.deepcopy(run)
    last.budget = im.Budget(iterations=onset + 1, onset=onset, seeds=1)
    assert math.isfinite(last.step(injected=True)["heldout_reward"])  # the last iteration is always evaluated


def test_the_threshold_lies_between_floor_and_ceiling_and_knobs_are_checked() -> None:
    assert im.InferenceMismatch.return_floor < im.REWARD_FLOOR < im.InferenceMismatch.return_ceiling
    assert im.InferenceMismatch(temperature=2.0).knobs.temperature == 2.0
    with pytest.raises(StabenchError, match="temperature must be a positive number"):
        im.InferenceMismatch(temperature=0)
    with pytest.raises(StabenchError, match="safe must be below"):
        im.InferenceMismatch(safe=1.0)
