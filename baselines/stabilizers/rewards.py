"""Terms added to the task's reward: what the learner is paid for besides being right.

- `brier-reward` (RLCR, Damani et al. 2025): where the policy states a confidence c in [0, 1] with each answer
  (the batch key "confidence", `Task.provides`), the binary correctness reward R becomes the proper score

      R' = R - (c - R)^2,

  maximized in expectation by stating the true chance of being right. R' replaces R in GRPO's group-normalized
  advantage, A_i = (R'_i - mean_group R') / (std_group R' + 1e-4), broadcast to the answer's tokens. A binary R
  alone gives a confidence token no expected gradient: the advantage does not depend on it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from stabench.baselines.stabilizers.aggregation import group_normalized
from stabench.suite.api import Stabilizer


def brier_reward(rewards: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
    """RLCR's reward: R - (c - R)^2 per answer."""
    return rewards - (confidence - rewards) ** 2


class BrierReward(Stabilizer):
    """GRPO's advantages recomputed from R - (c - R)^2 (see the module)."""

    name = "brier-reward"
    needs = frozenset({"confidence", "rewards", "group", "mask"})

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        paid = brier_reward(batch["rewards"].float(), batch["confidence"].float())
        return group_normalized(paid, batch["group"])[:, None] * batch["mask"]
