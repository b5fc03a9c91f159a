"""The KL term to a frozen reference: which estimator enters the loss, and an anchor to the reference.

With d = log ref - log pi on actions sampled from pi (Schulman's estimators of KL(pi || ref)):
k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d, none of them clamped (verl's `low_var_kl` clamps d to [-20, 20]
and k3 to at most 10; here a token the reference finds far likelier than pi contributes its full exp(d)).
Expected gradients, on-policy, per token (Shah et al. 2025, "A Comedy of Estimators"):

- k3 in the loss (GRPO's default, as in TRL): the gradient of the FORWARD KL(ref || pi), not of the
  reverse KL(pi || ref) the term is meant to bound; it barely resists mass moving onto tokens the
  reference finds rare, and it is mass-covering (it pulls mass back onto every answer the reference writes).
- k2 in the loss: the exact gradient of the per-token reverse KL (it omits the future-KL term of the
  sequence-level gradient).
- max(k2, k3) in the loss: k2 wherever the policy over-weights a token (d < 0, where k2 > k3), k3 where
  it under-weights one.
- k1 in the reward: no KL term in the loss; the detached per-token penalty beta * k1 is folded into the
  return, A_t <- A_t - beta * sum_{t' >= t} k1_t'. Times the score function this is the unbiased
  sequence-level reverse-KL gradient.

`kl-k2`, `kl-max` and `kl-k1-reward` change the trainer's own KL term at its own beta (`batch["kl_coef"]`).

KL anchor: a term coef * sum(w * k(ref, pi)) in the loss, w the trainer's aggregation weights. One
implementation, two settings:
- `kl-anchor`: k3 at coef 0.3, added beside the trainer's own KL term (the term DAPO/TTRL-style recipes drop;
  useful where the reference is a diverse policy, the warm start);
- `kl-k2-anchor`: k2 at coef 0.05, in place of the trainer's own KL term (a stronger reverse-KL anchor).
Both need a reference (`ref_logp`): a trainer without one has nothing to anchor to. `stabench tune` searches coef
on a log scale (`search_space`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from ray import tune
from stabench.baselines.stabilizers.clipping import token_weighted_sum
from stabench.suite.api import Stabilizer
from stabench.suite.diagnostics import kl_estimate


class KLk2InLoss(Stabilizer):
    """beta * k2 per token in the loss instead of k3."""

    name = "kl-k2"
    needs = frozenset({"ref_logp", "logp", "kl_coef"})

    def kl_loss(self, per_token_kl: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return kl_estimate(batch["logp"], batch["ref_logp"], "k2")


class KLMaxInLoss(Stabilizer):
    """beta * max(k2, k3) per token in the loss."""

    name = "kl-max"
    needs = frozenset({"ref_logp", "logp", "kl_coef"})

    def kl_loss(self, per_token_kl: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.maximum(kl_estimate(batch["logp"], batch["ref_logp"], "k2"), per_token_kl)


class KLk1InReward(Stabilizer):
    """No KL in the loss; A_t - beta * (sum over t' >= t of detached k1_t') as the per-token advantage."""

    name = "kl-k1-reward"
    needs = frozenset({"ref_logp", "logp", "kl_coef", "mask"})

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        k1 = kl_estimate(batch["logp"], batch["ref_logp"], "k1").detach() * batch["mask"]
        kl_to_go = k1.flip(-1).cumsum(-1).flip(-1)  # sum over the current and later tokens
        return advantages - batch["kl_coef"] * kl_to_go * batch["mask"]

    def kl_loss(self, per_token_kl: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.zeros_like(per_token_kl)


class KLAnchor(Stabilizer):
    """coef * sum(w * k3) beside the trainer's KL term: an anchor to the reference."""

    name = "kl-anchor"
    needs = frozenset({"ref_logp", "logp", "token_weight"})
    estimator: ClassVar[Literal["k2", "k3"]] = "k3"
    coef: ClassVar[float] = 0.3
    replace: ClassVar[bool] = False  # True: the anchor takes the place of the trainer's own KL term
    search_space = {"coef": tune.loguniform(0.01, 3.0)}  # two decades around both anchors' defaults

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        anchor = self.coef * token_weighted_sum(kl_estimate(batch["logp"], batch["ref_logp"], self.estimator), batch)
        return {**terms, ("kl" if self.replace else "kl_anchor"): anchor}


class KLk2Anchor(KLAnchor):
    """coef * sum(w * k2) in place of the trainer's KL term (a reverse-KL anchor at 0.05)."""

    name = "kl-k2-anchor"
    estimator: ClassVar[Literal["k2", "k3"]] = "k2"
    coef: ClassVar[float] = 0.05
    replace: ClassVar[bool] = True
