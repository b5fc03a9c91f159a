"""Resets: re-initialize part of the network when the agent's own return falls (a detected change, no oracle).

`head-reset` re-initializes the policy head (CleanRL's near-uniform init: orthogonal, gain 0.01, zero bias) and
restarts Adam when the smoothed reward rate falls well below the best it reached with this network. Resetting
the last layer is the primacy-bias remedy of Nikishin et al. (2022, "The primacy bias in deep RL"), who reset on
a fixed schedule; here the reset is triggered by the return itself, because a schedule would have to be tuned to
where the change falls. The rule reads only what the learner sees:

    rate_i = mean reward per environment step of iteration i's rollout
    smooth_i = mean of rate over the last `window` iterations
    best = max smooth_j since this network (or its last reset) began
    reset when  i >= window  and  best > 0  and  smooth_i < (1 - drop) * best,  then forget `best`

(a relative fall: it needs a positive reward rate to fall from, so on a task whose rewards stay at or below 0 it
never fires).

On the iteration of a reset the batch was collected by the policy that has just been found wanting, so the
policy takes no step on it: its advantages are zeroed (the value head still regresses on its returns) and its
old log-probabilities are those of the new head (the sampling ones stay in `behaviour_logp`). Measured on
primacy-bias (results/calibration.md, its design notes): trained on that batch, the fresh head re-learned the
old policy within about 15 updates. Every Adam moment restarts, the trunk's and the value head's included; the
trunk and the value head keep their weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from ray import tune
from stabench.baselines.models import POLICY_GAIN, init_head
from stabench.baselines.ppo import categorical_logprob_entropy
from stabench.suite.api import Stabilizer
from torch import nn


class HeadReset(Stabilizer):
    """Re-initialize the policy head when the smoothed reward rate falls by `drop` from its best."""

    name = "head-reset"
    trainers = frozenset({"ppo"})  # it re-initializes the `policy` head of the PPO tasks' actor-critic
    drop: float = 0.3
    window: int = 5
    seed: int = 0
    search_space: ClassVar[Mapping[str, Any]] = {"drop": tune.uniform(0.1, 0.6)}

    def __init__(self) -> None:
        self.net: nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.rates: list[float] = []
        self.best = float("-inf")
        self.resets = 0

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        if not isinstance(getattr(model, "policy", None), nn.Linear):
            raise TypeError("head-reset needs an actor-critic with a linear `policy` head")
        self.net, self.rates, self.best = model, [], float("-inf")  # a new network starts its own record
        return model

    def optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        self.opt = optimizer
        return optimizer

    def fell(self, rate: float) -> bool:
        """Record one iteration's reward rate; True when the smoothed rate fell `drop` below its best."""
        self.rates = (self.rates + [rate])[-self.window:]
        if len(self.rates) < self.window:
            return False
        smooth = sum(self.rates) / self.window
        self.best = max(self.best, smooth)
        return self.best > 0 and smooth < (1.0 - self.drop) * self.best

    def reset_head(self) -> None:
        init_head(self.net.policy, POLICY_GAIN, torch.Generator().manual_seed(self.seed * 1_000_003 + self.resets))
        if self.opt is not None:
            self.opt.state.clear()  # Adam starts every moment afresh
        self.resets += 1
        self.rates, self.best = [], float("-inf")

    def rollout(self, batch: dict[str, torch.Tensor], info: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        if self.net is None or not self.fell(float(batch["rewards"].mean())):
            return batch
        self.reset_head()
        with torch.no_grad():
            logp = categorical_logprob_entropy(self.net(batch["obs"])[0], batch["actions"])[0]
        return {**batch, "old_logp": logp, "anchor_logp": logp, "advantages": torch.zeros_like(batch["advantages"])}
