"""The 2025-26 stabilizers (`cispo`, `gspo`, `sapo`, `clip-cov`, `kl-cov`, `icepop`, `m2po`) on constructed batches,
each against a hand computation of its paper's formula (values and gradients), and where each acts: exactly where
its `needs` are provided, the ratio-shaping objectives only where some update's ratio leaves 1 (`policy_reuse`),
which follows the tasks' trainer configs."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from stabench.baselines.grpo import GRPOConfig
from stabench.baselines.stabilizers.clipping import policy_term, token_weighted_sum, trainer_ratio
from stabench.baselines.stabilizers.entropy import (
    ClipCov,
    KLCov,
    at_least_one,
    centred_covariance,
    clip_cov_candidates,
    kl_cov_loss,
)
from stabench.baselines.stabilizers.importance import M2PO, IcePop, TokenMIS, band_weight, m2po_mask
from stabench.baselines.stabilizers.objectives import CISPO, GSPO, SAPO, gspo_loss, sapo_gate, sequence_log_ratio
from stabench.suite import registry
from stabench.suite import tune as tuning
from stabench.suite.api import BEHAVIOUR_POLICY, POLICY_REUSE, Stabilizer, provided_keys
from stabench.suite.cli import main

pytestmark = pytest.mark.smoke

NEW = ("cispo", "gspo", "sapo", "clip-cov", "kl-cov", "icepop", "m2po")
# measured (the trainers' configs): one on-policy optimizer step per batch, so r = 1 on every update
ONE_STEP = {"kl-estimator-bias", "reward-hacking", "length-explosion", "inference-mismatch", "moe-routing"}


def batch_of(ratios, adv, mask=None, weights=None) -> dict[str, torch.Tensor]:
    """A batch whose ratio pi_theta / anchor is `ratios` (anchor = old = behaviour: the learner sampled), logp a leaf
    with grad, token_weight a token mean over `mask` unless given."""
    ratio = torch.tensor(ratios, dtype=torch.float64)
    anchor = torch.log(torch.full_like(ratio, 0.25))
    mask_t = torch.ones_like(ratio) if mask is None else torch.tensor(mask, dtype=torch.float64)
    adv_t = torch.tensor(adv, dtype=torch.float64).expand_as(ratio) * mask_t
    weight = mask_t / mask_t.sum() if weights is None else torch.tensor(weights, dtype=torch.float64)
    return {"logp": (anchor + torch.log(ratio)).requires_grad_(True), "anchor_logp": anchor, "old_logp": anchor,
            "behaviour_logp": anchor, "advantages": adv_t, "mask": mask_t, "token_weight": weight,
            "clip_low": torch.tensor(0.2, dtype=torch.float64), "clip_high": torch.tensor(0.2, dtype=torch.float64)}


def policy(stabilizer: Stabilizer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The stabilizer's policy term and its gradient w.r.t. logp."""
    batch["logp"].grad = None
    loss = stabilizer.loss({"policy": torch.tensor(0.0)}, batch)["policy"]
    loss.backward()
    return loss.detach(), batch["logp"].grad.clone()


def trainer(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's own clipped surrogate and its gradient."""
    batch["logp"].grad = None
    loss = token_weighted_sum(policy_term(trainer_ratio(batch), batch["advantages"], batch["clip_low"],
                                          batch["clip_high"]), batch)
    loss.backward()
    return loss.detach(), batch["logp"].grad.clone()


# --- CISPO ----------------------------------------------------------------------------------------------------------
def test_cispo_is_reinforce_with_a_clipped_detached_weight_and_clipped_tokens_keep_their_gradient() -> None:
    ratios, adv = [0.5, 1.1, 1.5, 5.0, 1.5], [-1.0, -1.0, 1.0, 2.0, -0.5]
    batch = batch_of(ratios, adv)
    loss, grad = policy(CISPO(), batch)
    w = torch.full((5,), 0.2, dtype=torch.float64)
    clipped = torch.tensor(ratios, dtype=torch.float64).clamp(0.0, 4.0)  # no lower bound, cap 1 + 3
    a = torch.tensor(adv, dtype=torch.float64)
    assert torch.allclose(loss, -(w * clipped * a * batch["logp"].detach()).sum())
    assert torch.allclose(grad, -w * clipped * a)  # d/dlogp of -sg(c) A logp
    _, ppo = trainer(batch)
    assert ppo[2] == 0 and grad[2] != 0  # r = 1.5 > 1.2 with A > 0: PPO's clip drops it, CISPO keeps it at 1.5
    assert ppo[0] == 0 and torch.isclose(grad[0], w[0] * 0.5)  # r = 0.5 < 0.8 with A < 0: clipped in PPO, not here
    assert torch.isclose(grad[1], ppo[1])  # inside the clip CISPO's gradient is the trainer's, -r A
    assert torch.isclose(grad[3], -w[3] * 4.0 * 2.0)  # r = 5 is capped at 4


def test_cispo_has_the_trainers_gradient_where_the_ratio_is_one() -> None:
    batch = batch_of([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[1.5], [-0.7]], [[1, 1, 1], [1, 1, 0]])
    assert torch.allclose(policy(CISPO(), batch)[1], trainer(batch)[1], rtol=1e-12, atol=0)


# --- GSPO -----------------------------------------------------------------------------------------------------------
def test_gspo_sequence_ratio_is_the_length_normalized_likelihood_ratio_over_real_tokens() -> None:
    batch = batch_of([[1.2, 0.9, 7.0], [1.0001, 1.0002, 1.0003]], [[1.0], [1.0]], [[1, 1, 0], [1, 1, 1]])
    log_s = sequence_log_ratio(batch["logp"], batch["anchor_logp"], batch["mask"])
    assert log_s.shape == (2, 1) and not log_s.requires_grad
    assert math.isclose(float(log_s[0]), (math.log(1.2) + math.log(0.9)) / 2)  # the padded 7.0 is left out
    assert math.isclose(float(log_s[1]), sum(math.log(1 + k * 1e-4) for k in (1, 2, 3)) / 3)


def test_gspo_clips_whole_sequences_at_3e_4_and_4e_4_and_scales_kept_ones_by_the_sequence_ratio() -> None:
    up, down = math.exp(5e-4), math.exp(-5e-4)  # s just outside 1 + 4e-4 and 1 - 3e-4
    inside = math.exp(3e-4)
    rows = [[up, up, up], [up, up, up], [down, down, down], [inside, 1.0, math.exp(6e-4)]]
    adv = [[1.0], [-1.0], [-2.0], [0.5]]
    batch = batch_of(rows, adv)
    loss, grad = policy(GSPO(), batch)
    s = torch.exp(sequence_log_ratio(batch["logp"], batch["anchor_logp"], batch["mask"]))
    assert math.isclose(float(s[3]), math.exp(3e-4))  # mean of (3e-4, 0, 6e-4): inside the band
    w = 1 / 12
    assert torch.all(grad[0] == 0)  # A > 0, s > 1 + 4e-4: the whole answer is clipped
    assert torch.allclose(grad[1], torch.full((3,), w * float(s[1]), dtype=torch.float64))  # A < 0: unclipped side
    assert torch.all(grad[2] == 0)  # A < 0, s < 1 - 3e-4: clipped
    assert torch.allclose(grad[3], torch.full((3,), -w * 0.5 * float(s[3]), dtype=torch.float64))
    per_seq = torch.max(-batch["advantages"][:, :1] * s, -batch["advantages"][:, :1] * s.clamp(1 - 3e-4, 1 + 4e-4))
    assert torch.isclose(loss, (per_seq * 3 * w).sum())  # every token carries its sequence's value


def test_gspo_has_the_trainers_gradient_at_the_first_update_and_acts_only_on_sequences() -> None:
    batch = batch_of([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[1.5], [-0.7]], [[1, 1, 1], [1, 1, 0]])
    assert torch.allclose(policy(GSPO(), batch)[1], trainer(batch)[1])
    per_token = gspo_loss(batch["logp"], batch["anchor_logp"], batch["advantages"], batch["mask"], 3e-4, 4e-4)
    assert per_token.shape == batch["logp"].shape
    for task in tasks():
        expected = task.trainer in ("grpo", "token-ppo", "tool-ppo") and POLICY_REUSE in provided_keys(task)
        assert registry.make_stabilizer("gspo").applies_to(task) == expected, task.id
    assert not any(registry.make_stabilizer("gspo").applies_to(t) for t in tasks() if t.trainer == "ppo")


# --- SAPO -----------------------------------------------------------------------------------------------------------
def sapo_grad(ratios, adv, **setting) -> torch.Tensor:
    stab = SAPO()
    for key, value in setting.items():
        setattr(stab, key, value)
    return policy(stab, batch_of(ratios, adv))[1]


def test_sapo_gate_value_and_gradient_follow_the_sigmoid_form() -> None:
    r = torch.tensor([0.5, 1.0, 1.3, 2.0], dtype=torch.float64)
    for tau in (1.0, 1.05, 4.0):
        assert torch.allclose(sapo_gate(torch.tensor(1.0), tau), torch.tensor(2 / tau))
        assert torch.all(sapo_gate(r, tau) < 4 / tau)
    ratios = [0.5, 1.0, 1.3, 2.0]
    grad = sapo_grad(ratios, [1.0, 1.0, -1.0, -1.0])
    tau = torch.tensor([1.0, 1.0, 1.05, 1.05], dtype=torch.float64)  # tau_pos where A > 0, tau_neg elsewhere
    weight = 1 / torch.cosh(tau * (r - 1) / 2) ** 2  # 4 sigma (1 - sigma)
    a = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    assert torch.allclose(grad, -0.25 * a * weight * r)  # d/dlogp of -A f(r), dr/dlogp = r


def test_sapo_is_the_trainer_at_r_one_the_unclipped_surrogate_as_tau_vanishes_and_shrinks_as_tau_grows() -> None:
    batch = batch_of([[1.0, 1.0], [1.0, 1.0]], [[2.0], [-1.0]])
    assert torch.allclose(policy(SAPO(), batch)[1], trainer(batch)[1])  # w(1) = 1 for every tau
    ratios, adv = [0.5, 0.9, 1.5, 3.0], [1.0, -1.0, 1.0, -1.0]
    unclipped = -0.25 * torch.tensor(adv, dtype=torch.float64) * torch.tensor(ratios, dtype=torch.float64)
    assert torch.allclose(sapo_grad(ratios, adv, tau_pos=1e-4, tau_neg=1e-4), unclipped, rtol=1e-6)
    sharp = sapo_grad(ratios, adv, tau_pos=200.0, tau_neg=200.0)
    assert torch.all(sharp.abs() < 1e-6 * unclipped.abs())  # away from r = 1 a large tau leaves no gradient
    soft = sapo_grad([1.2], [1.0])  # the defaults are soft: at r = 1.2, 99% of the unclipped gradient
    assert 0.98 < float(soft / (-1.2)) < 1.0


# --- Clip-Cov and KL-Cov ---------------------------------------------------------------------------------------------
def cov_batch() -> dict[str, torch.Tensor]:
    """Six real tokens and one pad, logp deviations and advantages chosen so the centred covariance is known."""
    logp = torch.tensor([[-0.5, -3.5, -2.0, -2.0], [-0.2, -2.0, -3.5, -9.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0, -2.0, 0.0, 0.0], [3.0, 0.0, -3.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
    batch = batch_of(torch.ones_like(logp).tolist(), 0.0, mask.tolist())
    batch.update(logp=logp.clone().requires_grad_(True), anchor_logp=logp.clone(), advantages=adv * mask)
    return batch


def test_the_centred_covariance_uses_the_real_tokens_means() -> None:
    batch = cov_batch()
    real = batch["mask"] > 0
    lp, a = batch["logp"].detach()[real], batch["advantages"][real]
    cov = centred_covariance(batch["logp"], batch["advantages"], batch["mask"])
    assert torch.allclose(cov[real], (lp - lp.mean()) * (a - a.mean()))
    # mean logp = -1.957, mean A = 0: cov 2.91, 3.09, 0, 0 / 5.27, 0, 4.63: the band (1, 5) holds three tokens
    in_band = clip_cov_candidates(batch["logp"], batch["anchor_logp"], batch["advantages"], batch["mask"],
                                  1.0, 5.0, 1.0, 1.0)
    assert in_band.tolist() == [[True, True, False, False], [False, False, True, False]]
    assert float(cov[1, 0]) > 5  # (1.757 x 3): above the band, never clipped by Clip-Cov


def test_clip_cov_drops_the_gradient_of_at_least_one_random_in_band_token_and_no_other() -> None:
    batch = cov_batch()
    torch.manual_seed(0)
    loss, grad = policy(ClipCov(), batch)
    dropped = (grad == 0) & (batch["advantages"] != 0)
    assert int(dropped.sum()) == 1  # max(int(2e-4 x 7), 1) = 1 of the 3 candidates
    assert dropped[0, 0] or dropped[0, 1] or dropped[1, 2]
    kept = (batch["advantages"] != 0) & ~dropped
    assert torch.allclose(grad[kept], -(batch["token_weight"] * batch["advantages"])[kept])  # r = 1: -w A
    picks = set()
    for seed in range(20):  # uniform among the candidates
        torch.manual_seed(seed)
        picks.add(tuple(torch.nonzero(ClipCov().selected(batch))[0].tolist()))
    assert picks == {(0, 0), (0, 1), (1, 2)}
    many = ClipCov()
    many.fraction = 0.3  # int(0.3 x 7) = 2
    assert int(many.selected(batch).sum()) == 2 and at_least_one(2e-4, 7) == 1 and at_least_one(0.3, 7) == 2


def test_clip_cov_selects_nothing_when_no_token_lies_in_the_band_and_skips_tokens_the_ratio_clip_holds() -> None:
    batch = batch_of([[1.0, 1.0], [1.0, 1.0]], [[0.1], [-0.1]])  # |cov| far below 1
    assert not ClipCov().selected(batch).any()
    assert torch.allclose(policy(ClipCov(), batch)[1], trainer(batch)[1])
    held = cov_batch()
    shift = torch.tensor([[math.log(2.5), 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    held["logp"] = (held["anchor_logp"] + shift).requires_grad_(True)
    candidates = clip_cov_candidates(held["logp"], held["anchor_logp"], held["advantages"], held["mask"],
                                     1.0, 5.0, 1.0, 1.0)
    assert not candidates[0, 0]  # r = 2.5 > 2 with A > 0: already held by the clip(r, 0, 2)


def test_kl_cov_penalizes_exactly_the_top_k_tokens_by_covariance() -> None:
    batch = cov_batch()
    ratio = torch.tensor([[1.1, 0.9, 1.0, 1.2], [1.3, 1.0, 0.8, 1.0]], dtype=torch.float64)
    batch["logp"] = (batch["anchor_logp"] + torch.log(ratio)).requires_grad_(True)
    stab = KLCov()
    top = stab.selected(batch)
    cov = centred_covariance(batch["logp"], batch["advantages"], batch["mask"])
    assert top.tolist() == [[False, False, False, False], [True, False, False, False]]  # max(int(2e-3 x 7), 1) = 1
    assert float(cov[1, 0]) == float(cov[batch["mask"] > 0].max())
    stab.fraction = 0.5  # int(3.5) = 3: the three largest covariances, padding never
    assert stab.selected(batch).tolist() == [[False, True, False, False], [True, False, True, False]]
    loss, grad = policy(KLCov(), batch)
    w, a, lr = batch["token_weight"], batch["advantages"], torch.log(ratio)
    sel = top.to(torch.float64)
    assert torch.allclose(loss, (w * (-a * ratio + 1.0 * lr.abs() * sel)).sum())  # unclipped, |log r| on the top-k
    assert torch.allclose(grad, w * (-a * ratio + torch.sign(lr) * sel))
    k2 = kl_cov_loss(batch["logp"], batch["anchor_logp"], a, top, 1.0, "k2")
    assert torch.allclose(k2, -a * ratio + 0.5 * lr**2 * sel)


def test_kl_cov_has_the_trainers_gradient_where_the_ratio_is_one() -> None:
    batch = cov_batch()
    assert KLCov().selected(batch).any()
    assert torch.allclose(policy(KLCov(), batch)[1], trainer(batch)[1], rtol=1e-12, atol=0)  # |log r|' = 0 at 0


# --- IcePop and M2PO ------------------------------------------------------------------------------------------------
def engine_batch(k, step, adv, mask=None) -> dict[str, torch.Tensor]:
    """pi_old / q = k per token, the learner moved to pi_theta / pi_old = `step` (inside PPO's clip)."""
    batch = batch_of(torch.full((len(k),), step).tolist(), adv, mask)
    behaviour = batch["anchor_logp"] - torch.log(torch.tensor(k, dtype=torch.float64))
    batch["behaviour_logp"] = behaviour
    return batch


def test_icepop_masks_exactly_the_tokens_whose_train_inference_ratio_leaves_the_band() -> None:
    k = [0.49, 0.51, 1.0, 4.9, 5.1]
    batch = engine_batch(k, 1.05, [1.0, -1.0, 1.0, -1.0, 1.0])
    weight = IcePop().weight(batch)
    assert torch.allclose(weight, torch.tensor([0.0, 0.51, 1.0, 4.9, 0.0], dtype=torch.float64))
    loss, grad = policy(IcePop(), batch)
    base = policy_term(torch.full((5,), 1.05, dtype=torch.float64), batch["advantages"], 0.2, 0.2)
    assert torch.allclose(loss, (0.2 * weight * base).sum())  # M(k) times the clipped term against pi_old
    assert grad[0] == 0 and grad[4] == 0 and (grad[1:4] != 0).all()
    same = IcePop()
    same.min_weight, same.max_weight = 0.0, 2.0  # no floor, beta = C: token-mis
    assert torch.equal(same.weight(batch), TokenMIS().weight(batch))
    assert torch.equal(band_weight(torch.zeros(3), 0.5, 5.0), torch.ones(3))  # where the learner sampled: weight 1


def test_m2po_masks_the_largest_squared_log_ratios_until_the_mean_of_the_rest_is_below_tau() -> None:
    log_r = torch.tensor([0.05, -0.5, 0.0, 0.3, 0.1, 2.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.float64)  # the 2.0 is padding
    # real squares 0.0025, 0.25, 0, 0.09, 0.01: mean of all 0.0705 >= 0.04; without 0.25 it is 0.025625 < 0.04
    assert m2po_mask(log_r, mask, 0.04).tolist() == [True, False, True, True, True, False]
    assert m2po_mask(log_r, mask, 0.08).tolist() == [True, True, True, True, True, False]  # already below
    # without 0.25 and 0.09 the rest's mean is 0.004167: a threshold of 0.01 drops both
    assert m2po_mask(log_r, mask, 0.01).tolist() == [True, False, True, False, True, False]
    assert m2po_mask(log_r, mask, 0.0).tolist() == [False, False, True, False, False, False]  # one stays
    assert m2po_mask(log_r, torch.zeros(6), 0.04).sum() == 0


def test_m2po_is_the_unclipped_ratio_to_the_behaviour_policy_on_the_kept_tokens() -> None:
    k = [1.0, 3.0, 1.25, 0.95]
    batch = engine_batch(k, 1.0, [1.0, 1.0, 1.0, 2.0])
    loss, grad = policy(M2PO(), batch)
    rho = torch.tensor(k, dtype=torch.float64)  # pi_theta / q (the learner still at pi_old)
    keep = m2po_mask(torch.log(rho), batch["mask"], 0.04).to(torch.float64)
    assert keep.tolist() == [1.0, 0.0, 1.0, 1.0]  # squares 0, 1.21, 0.050, 0.003: without 1.21 the mean is 0.017
    a = batch["advantages"]
    assert torch.allclose(loss, (0.25 * keep * -a * rho).sum())
    assert torch.allclose(grad, 0.25 * keep * -a * rho)  # no clip: rho = 1.25 with A > 0 keeps its gradient
    assert torch.allclose(m2po_mask(torch.log(rho), batch["mask"], 0.04).float(), keep.float())
    stale = engine_batch(k, 1.5, [1.0, 1.0, 1.0, 2.0])  # pi_theta moved: log(1.5 k) all large, one token stays
    assert m2po_mask(stale["logp"] - stale["behaviour_logp"], stale["mask"], 0.04).tolist() == [
        False, False, False, True]


# --- where they act ---------------------------------------------------------------------------------------------------
def tasks() -> list:
    return [registry.get_task(n) for n in registry.names("task")]


def test_each_applies_exactly_where_its_needs_are_provided() -> None:
    for task in tasks():
        keys = provided_keys(task)
        policy_gradient = task.trainer != "dqn"
        reuse, engine = POLICY_REUSE in keys, BEHAVIOUR_POLICY in keys
        expected = {"cispo": policy_gradient and reuse, "sapo": policy_gradient and reuse,
                    "kl-cov": policy_gradient and reuse, "clip-cov": policy_gradient,
                    "gspo": reuse and task.trainer in ("grpo", "token-ppo", "tool-ppo"),
                    "icepop": policy_gradient and engine, "m2po": policy_gradient and engine}
        for name in NEW:
            assert registry.make_stabilizer(name).applies_to(task) == expected[name], (name, task.id)
        assert reuse == (policy_gradient and task.id not in ONE_STEP), task.id


def test_policy_reuse_follows_the_grpo_tasks_configs() -> None:
    """A GRPO task declares `policy_reuse` exactly when a GRPO config of its module takes several steps per batch
    (clip-asymmetry's injected branch switches to its reuse config at onset: one module, two configs)."""
    for task in tasks():
        if task.trainer != "grpo":
            continue
        module = importlib.import_module(type(task).__module__)
        configs = [v for v in vars(module).values() if isinstance(v, GRPOConfig)]
        assert configs, task.id
        steps = {c.epochs * c.minibatches for c in configs}
        assert (POLICY_REUSE in task.provides) == (max(steps) > 1), task.id


def test_listed_with_their_settings_and_defaults_inside_the_search_space(capsys) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in NEW:
        cls = registry.resolve_class("stabilizer", name)
        assert cls.__module__.startswith("stabench.baselines.stabilizers.")
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert "settings:" in out.split(line, 1)[1].splitlines()[1], name
        for key, domain in tuning.search_space(cls).items():
            default = getattr(cls, key)
            if isinstance(default, str):
                assert default in domain.categories
            else:
                assert domain.lower < default < domain.upper, (name, key)
    assert (CISPO.eps_low, CISPO.eps_high, GSPO.eps_low, GSPO.eps_high) == (1.0, 3.0, 3e-4, 4e-4)
    assert (SAPO.tau_pos, SAPO.tau_neg, ClipCov.fraction, ClipCov.cov_low, ClipCov.cov_high) == (1.0, 1.05, 2e-4, 1, 5)
    assert (KLCov.fraction, KLCov.coef, KLCov.estimator, IcePop.min_weight, IcePop.max_weight) == (
        2e-3, 1.0, "abs", 0.5, 5.0)
    assert M2PO.threshold == 0.04
    assert registry.make_stabilizer("kl-cov@estimator=k2").estimator == "k2"
    assert registry.method_name("gspo@eps_high=0.001") == "gspo@eps_high=0.001"


def test_the_losses_run_guarded_and_leave_the_other_terms() -> None:
    batch = engine_batch([1.0, 1.3, 0.9, 1.0], 1.1, [1.0, -1.0, 0.5, -0.5])
    batch = {k: (v.float().detach().requires_grad_(True) if k == "logp" else v.float()) for k, v in batch.items()}
    for name in NEW:
        terms = registry.make_stabilizer(name).loss({"policy": torch.tensor(0.0), "value": torch.tensor(2.0)}, batch)
        assert set(terms) == {"policy", "value"} and terms["value"] == 2.0 and torch.isfinite(terms["policy"])
