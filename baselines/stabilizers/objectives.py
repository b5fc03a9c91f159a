"""Alternative policy objectives: the trainer's clipped surrogate replaced by another function of the same ratio.

Notation, per action (a token, or an environment step in PPO): logp = log pi_theta (with grad), anchor =
`anchor_logp`, the denominator of the trainer's own ratio (pi_old in GRPO and token-PPO, the stored sampling
log-prob in PPO and tool-PPO), r = exp(logp - anchor), A the advantage the trainer's term uses, w the trainer's
aggregation weights (`token_weight`), sg() a stop-gradient. The trainer minimizes, per action,
max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (`clipping.policy_term`), whose gradient is -A r grad(logp)
inside the clip and 0 on its far side. Each method below replaces that per-action loss and keeps the trainer's
aggregation, sum(per_action * w) (`clipping.token_weighted_sum`). `cispo_loss`, `gspo_loss` and `sapo_loss` are
the per-action math, pure functions of (logp, anchor, advantages, mask, settings), so they compare one to one
with another implementation's per-token loss matrix (verl's `compute_policy_loss_cispo`, `_gspo`, `_sapo` before
`agg_loss`).

- `cispo` (CISPO, MiniMax-M1, arXiv 2506.13585, Sec. 3.1, Eqs. 4-5): REINFORCE with a clipped, detached
  importance weight,  l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp.  Its gradient is
  -clip(r) A grad(logp): a token whose ratio left the range keeps its gradient, at the clipped weight, where
  PPO's clip zeroes it. Defaults: the paper sets no lower bound ("eps_low^IS set to a large value") and tunes
  only eps_high^IS without reporting the value; eps_low = 1 (the weight's floor is 0: no lower bound) and
  eps_high = 3 (a cap at 4, the default of the CISPO loss in Thinking Machines' Tinker, which cites ScaleRL,
  Khatri et al. 2025, arXiv 2510.13786). Inside [1 - clip_low, 1 + clip_high] the gradient is the trainer's,
  -r A grad(logp): it differs only where the trainer's clip binds, or where r > 4.
- `gspo` (GSPO, Zheng et al. 2025, arXiv 2507.18071, the objective of Eq. 5 with its sequence ratio; and the
  paper's GSPO-token variant): one ratio per sequence, the length-normalized likelihood ratio
  s_i = exp(mean over i's real tokens of (logp - anchor)), clipped at the sequence level with the paper's small
  range (its experiments set "the clipping ranges in Equation (5) to 3e-4 and 4e-4", left and right) and applied
  to the sequence advantage. Per token, GSPO-token's s_i,t = sg(s_i) exp(logp - sg(logp)) (the value s_i, the
  gradient s_i grad(logp)),  l = max(-A s_i,t, -A clip(s_i,t, 1 - eps_low, 1 + eps_high)).  With A_i,t = A_i
  (GRPO, tool-PPO) its gradient is GSPO's: s_i A_i times the mean over the answer of grad(logp) when unclipped,
  0 for the whole answer when s_i left the range on A's side. Aggregated like the trainer: on fixed-length
  answers every token aggregation equals the paper's 1/G sum_i 1/|y_i| sum_t up to a constant, and
  length-explosion's trainer already takes that sequence mean (verl's `gspo` always does; token-mean elsewhere
  differs from it only on answers of unequal length). It acts only where actions form sequences (`trainers`:
  the token trainers): on PPO's step rollouts a "sequence" would be one action, and GSPO would be the trainer's
  term with a 3e-4 clip, not the paper's method.
- `sapo` (SAPO, Gao et al. 2025, arXiv 2511.20347, its soft-gate objective): the hard clip replaced by a smooth
  sigmoid gate of the ratio,  l = -A f(r),  f(r) = sigma(tau (r - 1)) 4 / tau,  tau = tau_pos where A > 0, tau_neg
  elsewhere. Its gradient is -A w(r) r grad(logp) with w(r) = 4 sigma (1 - sigma) = sech^2(tau (r - 1) / 2):
  exactly the trainer's at r = 1 (w = 1, for every tau), smoothly down-weighted as r leaves 1, never zero. As
  tau -> 0 it tends to the unclipped surrogate -A r; as tau grows the region where w stays near 1 shrinks to
  r = 1 (it does not tend to a hard clip at the trainer's band). Defaults tau_pos = 1.0, tau_neg = 1.05, the
  paper's (tau_neg > tau_pos: negative advantages, which raise every unsampled token's logit, decay faster), as
  verl's SAPO example states them ("default values used in the paper") and AReaL's SAPO loss sets them. At
  these temperatures w(1.2) = 0.99: on the suite's ratios SAPO is close to the unclipped surrogate.

Where they act: each has the trainer's own gradient where r = 1 on every update (one on-policy step per batch),
CISPO and SAPO exactly, GSPO too (s_i = 1 and sum_t w_t grad(logp_t) is the trainer's gradient), so they need the
capability `policy_reuse` (`suite.api.POLICY_REUSE`: several optimizer steps per batch, or a ratio against another
sampler) and score as the baseline on the one-step tasks (kl-estimator-bias, reward-hacking, length-explosion,
inference-mismatch, moe-routing). On the others they differ from the trainer only on the updates whose ratios
move: the second and later steps on each batch, and every step of a run whose anchor is a lagged or different
sampler (parallel-staleness, the tool tasks).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from ray import tune
from stabench.baselines.stabilizers.clipping import POLICY_KEYS, token_weighted_sum
from stabench.suite.api import POLICY_REUSE, Stabilizer

MAX_LOG_RATIO = 20.0  # verl's guard on log r before exp() in CISPO and SAPO (no suite ratio comes near it)
GSPO_MAX_LOG_RATIO = 10.0  # verl's overflow guard on log s_i,t (never reached near the trust region)


def cispo_loss(logp: torch.Tensor, anchor_logp: torch.Tensor, advantages: torch.Tensor,
               eps_low: float, eps_high: float) -> torch.Tensor:
    """Per action -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp, r = exp(logp - anchor_logp) (CISPO, Eqs. 4-5)."""
    weight = torch.exp((logp - anchor_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).clamp(1 - eps_low, 1 + eps_high)
    weight = weight.detach()
    return -weight * advantages * logp


def sequence_log_ratio(logp: torch.Tensor, anchor_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = mean over the real tokens of answer i of (logp - anchor), [B, 1] (GSPO, Eq. 7), detached."""
    mask = mask.to(logp.dtype)
    log_ratio = ((logp - anchor_logp) * mask).detach().sum(-1, keepdim=True)
    return log_ratio / mask.sum(-1, keepdim=True).clamp_min(1)


def gspo_loss(logp: torch.Tensor, anchor_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_low: float, eps_high: float) -> torch.Tensor:
    """Per token (GSPO-token) max(-A s_i,t, -A clip(s_i,t, 1 - eps_low, 1 + eps_high)) with
    s_i,t = sg(s_i) pi_theta / sg(pi_theta): the value s_i on every token of answer i, the gradient s_i grad(logp)."""
    log_s = (logp - logp.detach() + sequence_log_ratio(logp, anchor_logp, mask)).clamp(max=GSPO_MAX_LOG_RATIO)
    s = torch.exp(log_s)
    return torch.max(-advantages * s, -advantages * s.clamp(1 - eps_low, 1 + eps_high))


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """SAPO's soft gate f(r) = sigma(tau (r - 1)) 4 / tau: f(1) = 2 / tau, f'(1) = 1, bounded by 4 / tau."""
    return torch.sigmoid(tau * (ratio - 1)) * (4 / tau)


def sapo_loss(logp: torch.Tensor, anchor_logp: torch.Tensor, advantages: torch.Tensor,
              tau_pos: float, tau_neg: float) -> torch.Tensor:
    """Per action -A f(r; tau), tau = tau_pos where A > 0, tau_neg elsewhere (SAPO's gate, as verl's `sapo`)."""
    tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
    return -advantages * sapo_gate(torch.exp((logp - anchor_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)), tau)


class CISPO(Stabilizer):
    """CISPO: -sg(clip(r, 0, 4)) A logp per action, aggregated like the trainer (see the module)."""

    name = "cispo"
    needs = POLICY_KEYS | {POLICY_REUSE}  # with r = 1 on every update its gradient is the trainer's
    eps_low: float = 1.0  # the weight's floor 1 - eps_low = 0: no lower bound, as the paper (Sec. 3.1)
    eps_high: float = 3.0  # the cap 1 + eps_high = 4 (not reported by the paper; Tinker's and ScaleRL's cap)
    search_space = {"eps_high": tune.loguniform(0.1, 10.0)}  # from a PPO-like cap 1.1 to a loose 11

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per_action = cispo_loss(batch["logp"], batch["anchor_logp"], batch["advantages"], self.eps_low, self.eps_high)
        return {**terms, "policy": token_weighted_sum(per_action, batch)}


class GSPO(Stabilizer):
    """GSPO: one clipped, length-normalized ratio per sequence, clip range 3e-4 / 4e-4 (see the module)."""

    name = "gspo"
    needs = POLICY_KEYS | {"mask", POLICY_REUSE}
    trainers = frozenset({"grpo", "token-ppo", "tool-ppo"})  # actions form sequences (answers, episodes), [B, L]
    eps_low: float = 3e-4  # the left clipping range of Eq. 5 in the paper's experiments
    eps_high: float = 4e-4  # the right clipping range
    search_space = {"eps_low": tune.loguniform(1e-4, 1e-2), "eps_high": tune.loguniform(1e-4, 1e-2)}

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per_token = gspo_loss(batch["logp"], batch["anchor_logp"], batch["advantages"], batch["mask"],
                              self.eps_low, self.eps_high)
        return {**terms, "policy": token_weighted_sum(per_token, batch)}


class SAPO(Stabilizer):
    """SAPO: -A sigma(tau (r - 1)) 4 / tau per action, tau_pos = 1.0, tau_neg = 1.05 (see the module)."""

    name = "sapo"
    needs = POLICY_KEYS | {POLICY_REUSE}  # with r = 1 on every update its gradient is the trainer's
    tau_pos: float = 1.0  # the paper's temperature for A > 0
    tau_neg: float = 1.05  # the paper's temperature for A <= 0
    search_space = {"tau_pos": tune.loguniform(0.3, 30.0), "tau_neg": tune.loguniform(0.3, 30.0)}

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per_action = sapo_loss(batch["logp"], batch["anchor_logp"], batch["advantages"], self.tau_pos, self.tau_neg)
        return {**terms, "policy": token_weighted_sum(per_action, batch)}
