"""Multi-skip residual trunk (Creus Castanyer et al. 2025, "Stable gradients for stable learning at scale
in deep reinforcement learning") with a scale-normalized critic loss: the matched fix of `dead-layers`.

The `model` hook discards the task's plain network and builds `baselines.models.MultiSkipResidualMLP` from
the same `spec` (obs_dim, n_actions, width, depth): x0 = LN(W_in h); x_k = Block(x_{k-1}) + x_{k-1} + x0
with Block = ReLU -> Linear -> LN -> ReLU -> Linear -> LN; (depth - 1) // 2 blocks, so about as many Linear
layers as the plain net, and the same policy/value heads and interface. The new weights are drawn from
torch's global generator, which the caller seeds.

The `loss` hook divides the critic's loss by max(1, mean squared return target of the minibatch), so a
critic whose targets are in units of 1000x rewards pulls on the shared trunk no harder than one in units of
the true reward (returns of at most 1 leave the loss unchanged). Stateless: nothing to branch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from baselines.models import MultiSkipResidualMLP
from suite.api import Stabilizer


class MultiSkipResidual(Stabilizer):
    name = "multiskip-residual"
    trainers = frozenset({"ppo"})

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        return MultiSkipResidualMLP(dict(spec))

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scale = batch["returns"].detach().pow(2).mean().clamp(min=1.0)
        return {**terms, "value": terms["value"] / scale}
