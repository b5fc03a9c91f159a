"""Entropy-collapse stabilizers for GRPO: DAPO's clip-higher and the two guards it is ablated against.

Per token, with r = pi / pi_old, advantage A and the trainer's aggregation weights w (batch["token_weight"]):

- clip-higher (DAPO, Yu et al. 2025): the policy term -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) with
  eps_high > eps_low (0.2 / 0.28). Only the upper bound moves: a token with positive advantage may raise its
  probability by 28% per batch instead of 20%, which DAPO argues lets low-probability (exploration) tokens
  grow. It changes nothing while r stays inside [0.8, 1.2], i.e. on the first update of a batch.
- grpo-entropy-bonus: minimize coef * sum w r log(pi).detach(), whose gradient is
  coef * E_pi[log pi grad log pi] = -coef * grad H(pi(. | prefix)) per token (samples from pi_old reweighted
  by r): a plain per-token entropy bonus from the sampled tokens alone.
- grpo-kl-anchor: the reference-KL term that DAPO/TTRL-style recipes drop, coef * sum w k3 with
  k3 = exp(d) - 1 - d, d = log ref - log pi (TRL's estimator in the loss; its expected gradient is that of the
  forward KL(ref || pi), which pulls mass back onto every answer the reference writes: mass-covering).
  Useful where the reference is a diverse policy (the warm start); with the trainer's own beta at 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from suite.api import Stabilizer


class ClipHigher(Stabilizer):
    """PPO-clip with a higher upper bound: clip(r, 1 - 0.2, 1 + 0.28) (DAPO)."""

    name = "clip-higher"
    trainers = frozenset({"grpo"})
    eps_low: float = 0.2
    eps_high: float = 0.28

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ratio = torch.exp(batch["logp"] - batch["old_logp"])
        adv = batch["advantages"]
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - self.eps_low, 1 + self.eps_high) * adv)
        return {**terms, "policy": (per_token * batch["token_weight"]).sum()}


class GRPOEntropyBonus(Stabilizer):
    """Per-token entropy bonus for GRPO from sampled tokens: + coef * sum w r log(pi).detach() in the loss."""

    name = "grpo-entropy-bonus"
    trainers = frozenset({"grpo"})
    coef: float = 0.3

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ratio = torch.exp(batch["logp"] - batch["old_logp"])
        surrogate = ratio * batch["logp"].detach()
        return {**terms, "entropy": self.coef * (surrogate * batch["token_weight"]).sum()}


class GRPOKLAnchor(Stabilizer):
    """coef * k3(ref, pi) per token in the loss, aggregated like the policy term (an anchor to the reference)."""

    name = "grpo-kl-anchor"
    trainers = frozenset({"grpo"})
    coef: float = 0.3

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        d = batch["ref_logp"] - batch["logp"]
        k3 = torch.expm1(d) - d
        return {**terms, "kl_anchor": self.coef * (k3 * batch["token_weight"]).sum()}
