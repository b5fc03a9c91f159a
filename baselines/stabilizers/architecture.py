"""Stabilizers that change the network: a multi-skip residual trunk, and a bounded reasoning context.

`multiskip-residual` (Creus Castanyer et al. 2025, "Stable gradients for stable learning at scale in deep
reinforcement learning") with a scale-normalized critic loss. The `model` hook discards the task's plain
actor-critic and builds `stabench.baselines.models.MultiSkipResidualMLP` from the same `spec` (obs_dim,
n_actions, width, depth): x0 = LN(W_in h); x_k = Block(x_{k-1}) + x_{k-1} + x0 with Block = ReLU -> Linear
-> LN -> ReLU -> Linear -> LN; (depth - 1) // 2 blocks, so about as many Linear layers as the plain net, and
the same policy/value heads and interface. The new weights are drawn from torch's global generator, which the
caller seeds. The `loss` hook divides the critic's loss by max(1, mean squared return target of the
minibatch), so a critic whose targets are in units of 1000x rewards pulls on the shared trunk no harder than
one in units of the true reward (returns of at most 1 leave the loss unchanged). Stateless.

`markovian-chunks`: Markovian chunked reasoning (Delethink, Aghajohari et al. 2025, "The Markovian Thinker"):
the policy reasons in chunks; after the first `chunk` reasoning tokens its context is reset to the prompt
plus the last `carry` tokens, so the state it conditions on is bounded. It needs a policy that exposes
`bound_context(chunk, carry)` (a task says so with `provides = {"bound_context"}`); it bounds what each chunk
costs, not the incentive to think longer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from stabench.baselines.models import MultiSkipResidualMLP
from stabench.suite.api import StabenchError, Stabilizer
from torch import nn


class MultiSkipResidual(Stabilizer):
    name = "multiskip-residual"
    trainers = frozenset({"ppo"})  # it rebuilds the actor-critic MLP of the PPO tasks from their spec
    needs = frozenset({"returns"})

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        return MultiSkipResidualMLP(dict(spec))

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scale = batch["returns"].detach().pow(2).mean().clamp(min=1.0)
        return {**terms, "value": terms["value"] / scale}


class MarkovianChunks(Stabilizer):
    """Bounded-context reasoning: chunks of `chunk` tokens, `carry` of them carried over at each reset."""

    name = "markovian-chunks"
    needs = frozenset({"bound_context"})  # a task whose policy can bound its context provides it
    chunk: ClassVar[int] = 6
    carry: ClassVar[int] = 2

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        if not hasattr(model, "bound_context"):
            raise StabenchError("markovian-chunks needs a policy with bound_context(chunk, carry)")
        model.bound_context(self.chunk, self.carry)
        return model
