"""Stabilizers that bound the update: the policy term's clip (clip-higher, dual clip) and the gradient's norm.

Every policy-gradient trainer minimizes, per action, the clipped surrogate

    s = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),   r = exp(logp - anchor_logp),

aggregated as sum(s * token_weight) (`suite.api.BATCH_SCHEMA`; the anchor is the stored sampling log-prob
in PPO and tool-PPO, the learner's recomputed pi_old in GRPO and token-PPO). `policy_term` and
`token_weighted_sum` below are that computation, shared by every stabilizer that rewrites the term (here,
`importance.py`, `aggregation.py`).

- `clip-higher` (DAPO, Yu et al. 2025): the upper bound raised to 1 + 0.28, the lower kept at 1 - 0.2. A
  token with positive advantage may then raise its probability by 28% per batch instead of 20%, which DAPO
  argues lets low-probability (exploration) tokens grow. It changes nothing while r stays inside
  [0.8, 1.2], i.e. on the first update of a batch.
- `dual-clip` (Ye et al. 2020): on negative advantages the term is bounded by -c A, c = 3:
  s = A < 0 ? min(max(-A r, -A clip(r)), -c A) : max(-A r, -A clip(r)). It caps what one action with a
  huge ratio and a negative advantage can contribute.
- `advantage-clip`: every advantage clipped to [-1, 1] before the update. Under group normalization one lucky
  success in a group of 8 gets A = 2.47; clipped, it weighs no more than an answer of a balanced group. A
  named non-fix on hard-sample-shortcuts: it shrinks the lucky push, it does not remove it.
- `grad-clip`: rescale all gradients together so their joint L2 norm is at most 0.5 (CleanRL's default,
  kept out of the trainers). A named non-fix on the grid tasks: Adam normalizes the length away again.

Each declares the coefficient `stabench tune` searches (`search_space`); the values above are the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from ray import tune
from stabench.suite.api import Stabilizer
from torch import nn

POLICY_KEYS = frozenset({"logp", "anchor_logp", "advantages", "token_weight", "clip_low", "clip_high"})


def policy_term(ratio: torch.Tensor, adv: torch.Tensor, low: torch.Tensor | float,
                high: torch.Tensor | float) -> torch.Tensor:
    """Per-action negative clipped objective max(-A r, -A clip(r, 1 - low, 1 + high))."""
    return torch.max(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))


def trainer_ratio(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The ratio every trainer's own policy term uses: pi_theta / the trainer's anchor (`anchor_logp`)."""
    return torch.exp(batch["logp"] - batch["anchor_logp"])


def token_weighted_sum(per_action: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A loss term the way the trainer aggregates its own: sum(per_action * token_weight)."""
    return (per_action * batch["token_weight"]).sum()


class ClipHigher(Stabilizer):
    """The trainer's policy term with clip(r, 1 - 0.2, 1 + 0.28) (DAPO)."""

    name = "clip-higher"
    needs = POLICY_KEYS
    eps_low: float = 0.2
    eps_high: float = 0.28
    search_space = {"eps_high": tune.uniform(0.2, 0.6)}  # from the symmetric clip to three times its width

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per_action = policy_term(trainer_ratio(batch), batch["advantages"], self.eps_low, self.eps_high)
        return {**terms, "policy": token_weighted_sum(per_action, batch)}


class DualClip(Stabilizer):
    """The trainer's policy term, bounded by -c A on negative advantages (c = 3)."""

    name = "dual-clip"
    needs = POLICY_KEYS
    c: float = 3.0
    search_space = {"c": tune.uniform(1.5, 10.0)}

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        adv = batch["advantages"]
        per_action = policy_term(trainer_ratio(batch), adv, batch["clip_low"], batch["clip_high"])
        per_action = torch.where(adv < 0, torch.min(per_action, -self.c * adv), per_action)
        return {**terms, "policy": token_weighted_sum(per_action, batch)}


class AdvantageClip(Stabilizer):
    """A clipped to [-c, c], c = 1, on every action."""

    name = "advantage-clip"
    needs = frozenset({"advantages"})
    c: float = 1.0
    search_space = {"c": tune.loguniform(0.3, 3.0)}

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return advantages.clamp(-self.c, self.c)


class GradClip(Stabilizer):
    """Global gradient-norm clipping at 0.5 (parameters without a gradient are left out)."""

    name = "grad-clip"
    max_norm: float = 0.5
    search_space = {"max_norm": tune.loguniform(0.05, 5.0)}  # a decade either side of CleanRL's 0.5

    def after_backward(self, model: nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)
