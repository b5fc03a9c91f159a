"""Critic warm-up after a value head is replaced (value pretraining, Yuan et al. 2025, VC-PPO), and a plain
entropy guard for the token-PPO trainer. The matched fix of `value-cold-start` and its named non-fix.

Critic warm-up. For the first `iterations` iterations after the trainer replaced its critic
(`batch["critic_resets"] > 0` and `batch["critic_age"] < iterations`) only the critic trains: the loss is

    L = sum_t w_t (V(s_t) - G^MC_t)^2 / 2,

with G^MC the Monte-Carlo return-to-go (`batch["returns"]`, lambda = 1 targets, as VC-PPO pretrains its
value model) and w the trainer's token weights; the policy and entropy terms are dropped, so the policy's
parameters get no gradient and its Adam does not step (a parameter without a gradient is skipped). Why
Monte-Carlo targets: the trainer's own lambda-return targets G_t = A_t + V(s_t) bootstrap from the critic
being repaired ((1 - lambda) V(s_{t+1}) per step), so a badly scaled head chases its own errors; regressing
on the sampled return removes them at the rate of a supervised fit. After the warm-up the trainer's terms
pass unchanged. The critic the trainer was built with is not warmed up (`critic_resets` is 0 for it).

Entropy guard. An entropy bonus on the policy: the loss gains -coef * sum_t w_t H(pi(. | s_t)) (replacing the
trainer's own entropy term, 0 by default). It keeps the policy from committing, whatever the advantages say.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from suite.api import Stabilizer


def warmup_value_loss(new_values: torch.Tensor, returns: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
    """sum_t w_t (V_t - G^MC_t)^2 / 2: the critic-only loss of the warm-up."""
    return (0.5 * (new_values - returns).pow(2) * token_weight).sum()


class CriticWarmup(Stabilizer):
    """Train only the critic, on Monte-Carlo returns, for `iterations` iterations after a critic reset."""

    name = "critic-warmup"
    trainers = frozenset({"token-ppo"})
    iterations: int = 20

    def warming(self, batch: Mapping[str, torch.Tensor]) -> bool:
        return int(batch["critic_resets"]) > 0 and int(batch["critic_age"]) < self.iterations

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.warming(batch):
            return terms
        return {"value": warmup_value_loss(batch["new_values"], batch["returns"], batch["token_weight"])}


class PPOEntropyBonus(Stabilizer):
    """-coef * token-mean entropy of the policy in the loss (the plain guard)."""

    name = "ppo-critic-entropy-bonus"
    trainers = frozenset({"token-ppo"})
    coef: float = 0.05

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**terms, "entropy": -self.coef * (batch["entropy"] * batch["token_weight"]).sum()}
