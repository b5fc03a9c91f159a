"""Multi-skip residual trunk (Creus Castanyer et al. 2025, "Stable gradients for stable learning at scale
in deep reinforcement learning"): the matched fix of the `dead-layers` task.

The `model` hook discards the task's plain network and builds `baselines.models.MultiSkipResidualMLP`
from the same `spec` (obs_dim, n_actions, width, depth): x0 = LN(W_in h); x_k = Block(x_{k-1}) + x_{k-1}
+ x0 with Block = ReLU -> Linear -> LN -> ReLU -> Linear -> LN; (depth - 1) // 2 blocks, so about as many
Linear layers as the plain net, and the same policy/value heads and interface. The new weights are drawn
from torch's global generator, which the caller seeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from baselines.models import MultiSkipResidualMLP
from suite.api import Stabilizer


class MultiSkipResidual(Stabilizer):
    name = "multiskip-residual"
    trainers = frozenset({"ppo"})

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        return MultiSkipResidualMLP(dict(spec))
