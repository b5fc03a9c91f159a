"""Against length explosion in GRPO: unbiased token aggregation, Markovian chunked reasoning, and a plain guard.

Per-sequence normalization (GRPO's loss, `aggregation="seq-mean"`) weighs answer i's tokens by 1 / (N |o_i|):

    L = -(1/N) sum_i A_i (1/|o_i|) sum_t log pi(o_i,t).

With A_i < 0 (a wrong answer under a baseline that leaves negative advantages, e.g. the batch mean on a
prompt nobody can solve) the push-down on a long answer is diluted by its length: minimizing L rewards
length (Liu et al. 2025, Understanding R1-Zero-Like Training, "Dr. GRPO").

- `constant-norm`: the policy term aggregated with a constant, sum_{i,t} per_token_i,t mask_i,t / (N L_max):
  every token weighs the same whatever the length of its answer, so the objective is the unbiased policy
  gradient up to a constant factor. Only the aggregation changes; the advantages are the trainer's.
- `dr-grpo`: constant normalization plus the group-mean baseline without std division, A_i = R_i - mean_group R
  (Dr. GRPO). A group whose rewards are all equal then gets A = 0 and no length pressure at all.
- `markovian-chunks`: Markovian chunked reasoning (Delethink, Aghajohari et al. 2025, The Markovian Thinker):
  the policy reasons in chunks; after the first `chunk` reasoning tokens its context is reset to the prompt
  plus the last `carry` tokens, so the state it conditions on is bounded. Needs a model that exposes
  `bound_context(chunk, carry)` (the reasoning tasks' policies do); it bounds what each chunk costs, not
  the incentive to think longer.
- `token-entropy-bonus`: the plain guard, a per-token entropy bonus folded into the advantage,
  A_t <- A_t - c log pi(o_t): its expectation times the score function is c times the gradient of the
  entropy of each visited next-token distribution (E[-log pi grad log pi] = grad H, since E[grad log pi] = 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from suite.api import StabenchError, Stabilizer


def constant_normalized_policy_loss(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The clipped policy term, sum(per_token * mask) / mask.numel(), from a GRPO minibatch."""
    ratio = torch.exp(batch["logp"] - batch["old_logp"])
    adv = batch["advantages"]
    clipped = ratio.clamp(1 - batch["clip_low"], 1 + batch["clip_high"])
    per_token = -torch.min(ratio * adv, clipped * adv)
    mask = batch["mask"]
    return (per_token * mask).sum() / mask.numel()


class ConstantNorm(Stabilizer):
    """Constant normalization of the policy term (the unbiased token aggregation of Dr. GRPO).

    The KL term keeps the trainer's aggregation (the length-explosion task runs with beta = 0).
    """

    name = "constant-norm"
    trainers = frozenset({"grpo"})

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**terms, "policy": constant_normalized_policy_loss(batch)}


class DrGRPO(ConstantNorm):
    """Dr. GRPO: A_i = R_i - mean_group R (no std division), and constant normalization of the policy term."""

    name = "dr-grpo"

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        rewards, group = batch["rewards"].float(), batch["group"]
        n = int(group.max()) + 1
        total = torch.zeros(n).index_add_(0, group, rewards)
        count = torch.zeros(n).index_add_(0, group, torch.ones_like(rewards))
        centred = rewards - (total / count)[group]
        return centred[:, None] * batch["mask"]


class MarkovianChunks(Stabilizer):
    """Bounded-context reasoning: chunks of `chunk` tokens, `carry` of them carried over at each reset."""

    name = "markovian-chunks"
    trainers = frozenset({"grpo"})
    chunk: ClassVar[int] = 6
    carry: ClassVar[int] = 2

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        if not hasattr(model, "bound_context"):
            raise StabenchError("markovian-chunks needs a policy with bound_context(chunk, carry) (a reasoning task)")
        model.bound_context(self.chunk, self.carry)
        return model


class TokenEntropyBonus(Stabilizer):
    """The plain guard: A_t <- A_t - coef * log pi(o_t) on every answer token (detached log-probs)."""

    name = "token-entropy-bonus"
    trainers = frozenset({"grpo"})
    coef: ClassVar[float] = 0.01

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return advantages - self.coef * batch["logp"].detach() * batch["mask"]
