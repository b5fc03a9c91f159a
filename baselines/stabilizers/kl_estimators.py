"""Where the KL estimator goes in GRPO: fixes for "k3 in the loss" (Shah et al. 2025, A Comedy of Estimators).

With d = log ref - log pi on tokens sampled from pi (Schulman's estimators of KL(pi || ref)):
k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d. Expected gradients, on-policy, per token:

- k3 in the loss (GRPO's default, as in TRL): the gradient of the FORWARD KL(ref || pi), not of the
  reverse KL(pi || ref) the term is meant to bound; it barely resists mass moving onto tokens the
  reference finds rare.
- k2 in the loss: the exact gradient of the per-token reverse KL (it omits the future-KL term of the
  sequence-level gradient).
- max(k2, k3) in the loss: k2 wherever the policy over-weights a token (d < 0, where k2 > k3), k3 where
  it under-weights one.
- k1 in the reward: no KL term in the loss; the detached per-token penalty beta * k1 is folded into the
  return, A_t <- A_t - beta * sum_{t' >= t} k1_t'. Times the score function this is the unbiased
  sequence-level reverse-KL gradient.

All read beta from `batch["kl_coef"]`, the coefficient the GRPO trainer uses for its own KL term.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from suite.api import Stabilizer


def _k2(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return 0.5 * (batch["ref_logp"] - batch["logp"]).pow(2)


class KLk2InLoss(Stabilizer):
    """beta * k2 per token in the loss instead of k3."""

    name = "kl-k2"
    trainers = frozenset({"grpo"})

    def kl_loss(self, per_token_kl: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _k2(batch)


class KLMaxInLoss(Stabilizer):
    """beta * max(k2, k3) per token in the loss."""

    name = "kl-max"
    trainers = frozenset({"grpo"})

    def kl_loss(self, per_token_kl: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.maximum(_k2(batch), per_token_kl)


class KLk1InReward(Stabilizer):
    """No KL in the loss; A_t - beta * (sum over t' >= t of detached k1_t') as the per-token advantage."""

    name = "kl-k1-reward"
    trainers = frozenset({"grpo"})

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        k1 = (batch["logp"] - batch["ref_logp"]).detach() * batch["mask"]
        kl_to_go = k1.flip(-1).cumsum(-1).flip(-1)  # sum over the current and later tokens
        return advantages - batch["kl_coef"] * kl_to_go * batch["mask"]

    def kl_loss(self, per_token_kl: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.zeros_like(per_token_kl)
