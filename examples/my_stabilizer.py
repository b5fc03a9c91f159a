"""An example stabilizer in one file: clip advantages to [-2, 2] before they enter the policy loss.

Large advantages are one way a few samples dominate an update. This is the whole plugin: subclass
`Stabilizer`, give it a unique `name` (and a `version`), override the hooks you need.

    stabench run --tier quick --stabilizer examples/my_stabilizer.py:AdvantageClip
"""

import torch

from suite import Stabilizer


class AdvantageClip(Stabilizer):
    name = "advantage-clip"
    version = "1"
    trainers = frozenset({"ppo", "grpo"})  # the trainers whose `advantages` hook this changes
    limit = 2.0

    def advantages(self, advantages: torch.Tensor, batch) -> torch.Tensor:
        return advantages.clamp(-self.limit, self.limit)
