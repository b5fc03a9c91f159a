"""Entropy bonus: one implementation for every trainer, two named settings.

The loss gains a term  -coef * sum_t w_t H(pi_theta(. | s_t)),  with H the exact per-action entropy carrying
the graph (`batch["entropy"]`) and w the trainer's aggregation weights (`token_weight`): it is added to
whatever entropy term the trainer has (PPO's own ent_coef 0.01; none in GRPO and tool-PPO; 0 in token-PPO).
It keeps the policy from committing whatever the advantages say, without touching anything else, which is
why it is the plain guard most fixes are ablated against: if it does as well as a fix, the failure ran
through entropy.

- `entropy-bonus`: coef 0.05.
- `entropy-bonus-low`: coef 0.01 (a weak guard: on missing-critic a strong bonus holds the policy near
  uniform and fails the control too, so only a weak one measures what entropy alone does there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from ray import tune
from stabench.baselines.stabilizers.clipping import token_weighted_sum
from stabench.suite.api import Stabilizer


def entropy_bonus(batch: Mapping[str, torch.Tensor], coef: float) -> torch.Tensor:
    """-coef * sum(token_weight * entropy): the term an entropy bonus adds to the loss."""
    return -coef * token_weighted_sum(batch["entropy"], batch)


class EntropyBonus(Stabilizer):
    name = "entropy-bonus"
    needs = frozenset({"entropy", "token_weight"})
    coef: ClassVar[float] = 0.05
    search_space = {"coef": tune.loguniform(0.001, 0.3)}  # from barely there to a policy held near uniform

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**terms, "entropy_bonus": entropy_bonus(batch, self.coef)}


class EntropyBonusLow(EntropyBonus):
    name = "entropy-bonus-low"
    coef: ClassVar[float] = 0.01
