"""Global gradient-norm clipping: rescale all gradients together so their joint L2 norm is at most 0.5.

Kept as a named non-fix (a control for a claim): on the `dead-layers` task the reward-scale shock makes
the value loss dominate the shared trunk's gradient. Clipping shrinks the gradient's length but not its
direction, and Adam normalizes the length away again, so the update the value loss imposes is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from suite.api import Stabilizer


class GradClip(Stabilizer):
    name = "grad-clip"
    max_norm: float = 0.5

    def after_backward(self, model: nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)
