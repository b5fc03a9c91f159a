"""inference-mismatch: the engine-gap diagnostics on constructed cases, the soft-capped sampler, GRPO's sampler
path (behaviour vs anchor log-probs), the sequence-level IS formula, the environment, the exact evaluation and
the branching of a run."""

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
    assert gap["engine_prob_diff_max"] == pytest.approx(0.25)  # |0.25 - 0.5| and |0.5 - 0.25|; 0.9 is padding
    assert gap["engine_low_ratio"] == pytest.approx(1 / 3)  # pi / mu = 0.005 < 1e-2 on one token of three


def test_soft_cap_bounds_the_logit_range_keeps_the_order_and_follows_the_learner() -> None:
    policy = im.warm_policy()
    sampler = im.SoftCapSampler(policy, cap=2.0)
    ids = torch.tensor([[im.N_ACTIONS, 1, 4, 0]])
    with torch.no_grad():
        z = policy(input_ids=ids).logits[..., : im.N_ACTIONS]
        capped = sampler(input_ids=ids).logits[..., : im.N_ACTIONS]
    assert float(capped.max()) == 0.0 and float(capped.min()) > -2.0
    assert torch.equal(z.argsort(-1), capped.argsort(-1))  # same ranking, flatter distribution
    assert (torch.softmax(capped, -1).min() > torch.softmax(z, -1).min()).item()  # a fatter tail
    assert list(sampler.parameters()) == []  # shares the learner's weights, owns none
    with torch.no_grad():
        policy.lm_head.weight.mul_(3.0)
        assert not torch.allclose(sampler(input_ids=ids).logits[..., : im.N_ACTIONS], capped)


def test_grpo_hands_the_sampler_log_probs_as_behaviour_and_anchors_on_the_learner() -> None:
    run = im.InferenceMismatch().build("smoke", 0, Stabilizer())
    trainer = run.trainer
    prompts = im.TRAIN_PROMPTS[:8]
    own = trainer.iterate(im.correct_new, prompts)
    assert torch.equal(own.batch["behaviour_logp"], own.batch["old_logp"])
    assert torch.equal(own.batch["anchor_logp"], own.batch["old_logp"])
    sampler = im.SoftCapSampler(trainer.policy)
    state = trainer.iterate(im.correct_new, prompts, sampler=sampler)
    b = state.batch
    with torch.no_grad():
        from stabench.tasks.worlds.tokens import answer_logits

        mu = torch.log_softmax(answer_logits(sampler, b["prompts"], b["answers"], im.N_ACTIONS), -1)
    assert torch.equal(b["anchor_logp"], b["old_logp"])
    assert not torch.allclose(b["behaviour_logp"], b["old_logp"])
    # behaviour_logp is the sampler's before the update; the sampler now serves the updated weights
    assert torch.allclose(b["behaviour_logp"], mu.gather(-1, b["answers"][..., None]).squeeze(-1), atol=0.5)


def test_seq_tis_weighs_each_answer_by_its_truncated_sequence_ratio() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.5], [0.3, 0.3]]))  # sequence ratios 2 and 9 (truncated at 2)
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    batch = {"logp": logp, "old_logp": old, "behaviour_logp": behaviour, "anchor_logp": old, "advantages": adv,
             "mask": mask, "token_weight": mask / 4, "clip_low": torch.tensor(0.2),
             "clip_high": torch.tensor(0.2)}  # fmt: skip
    seq = SequenceTIS().loss({"policy": torch.tensor(0.0)}, batch)["policy"]
    assert float(seq) == pytest.approx((2 * -1 * 2 + 2 * 1 * 2) / 4)  # -A r w, r = 1, both weights 2
    half = {**batch, "behaviour_logp": torch.log(torch.tensor([[0.5, 1.0], [0.9, 0.9]]))}  # ratios 0.5 and 1
    assert float(SequenceTIS().loss({"policy": torch.tensor(0.0)}, half)["policy"]) == pytest.approx(
        (2 * -1 * 0.5 + 2 * 1 * 1.0) / 4
    )
    tok = TokenTIS().loss({"policy": torch.tensor(0.0)}, half)["policy"]  # per token: 1, 0.5, 1, 1
    assert float(tok) == pytest.approx((-1 - 0.5 + 1 + 1) / 4)


def test_environment_passes_check_env_and_pays_the_rule_in_force() -> None:
    env = gym.make("stabench/InferenceMismatch-v0").unwrapped
    check_env(env, skip_render_check=True)
    for after_onset, want in ((False, 1.0), (True, 0.0)):
        env = im.InferenceMismatchEnv(after_onset=after_onset)
        env.reset(seed=0)
        env.prompt = torch.tensor([[im.N_ACTIONS, 1, 4]])  # (a, b) = (1, 4)
        rewards = [env.step(x)[1] for x in (0, 2, 5)]  # avoids 1 and 4, but holds a 5
        assert rewards[:2] == [0.0, 0.0] and rewards[2] == want
    with pytest.raises(ValueError):
        im.InferenceMismatchEnv().step(9)


def test_exact_evaluation_and_the_ground_truth_against_a_learner_that_does_not_learn() -> None:
    policy = im.warm_policy()
    own = im.heldout_stats(policy, None)
    assert own["gt_engine_kl"] == 0.0
    assert own["heldout_accuracy"] < im.ACCURACY_FLOOR  # the warm start fails the new rule
    capped = im.heldout_stats(policy, im.SoftCapSampler(policy))
    assert capped["heldout_accuracy"] == own["heldout_accuracy"] and capped["gt_engine_kl"] > 0.1
    assert im.InferenceMismatch.return_floor < im.ACCURACY_FLOOR < im.InferenceMismatch.return_ceiling


def test_branches_differ_only_in_the_sampler() -> None:
    task = im.InferenceMismatch()
    run = task.build("smoke", 0, Stabilizer())
    onset = task.budget("smoke").onset
    for _ in range(onset):
        healthy = run.step(injected=False)
    assert healthy["engine_kl"] == 0.0
    row_i = copy.deepcopy(run).step(injected=True)
    row_c = copy.deepcopy(run).step(injected=False)
    assert row_i["engine_kl"] > 0 and row_i["gt_engine_kl"] > 0
    assert row_c["engine_kl"] == 0.0 and row_c["gt_engine_kl"] == 0.0
    assert row_i["step"] == row_c["step"]  # the same healthy phase, one iteration each
    assert {"return", "entropy", "heldout_accuracy", "engine_low_ratio"} <= set(row_i)


def test_knobs_are_checked() -> None:
    assert im.InferenceMismatch(cap=3.0).knobs.cap == 3.0
    with pytest.raises(StabenchError, match="cap must be a positive number"):
        im.InferenceMismatch(cap=0)
