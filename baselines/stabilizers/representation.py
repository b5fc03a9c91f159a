"""Isotropic Gaussian features (Saheb et al. 2026, "Stable deep RL via isotropic Gaussian representations"):
a regularizer on the features the policy head reads.

The features z are the input of the policy head (the trunk's
output that both heads read). Each minibatch draws M = 16 fresh random unit directions u_m, projects the
batch on them, s = z u_m, and compares the empirical characteristic function of each projection with the
standard normal's on 8 points t in [-5, 5]:

    loss = mean over (m, t) of (mean_batch cos(t s) - exp(-t^2 / 2))^2 + (mean_batch sin(t s))^2

and adds `lam * loss` to the trainer's loss through the `loss` hook. lam = 5: on version 1 of the task
then named representation-collapse (now `primacy-bias`) the usual 0.2-1.0 changed nothing, while 5 helped
some seeds but already slows learning from scratch (10 and 25 slow it more and help less). lam is the method's
public setting (`isotropic-gaussian@lam=1`), the one path a task sets it by too (primacy-bias's knob
`isotropic_lam`); the class default stays 5. A batch of
standard-normal features scores about (1 - e^{-t^2}) / (2 B) per point, i.e. near 0; collapsed (constant)
features score O(1).
The features are read without touching the trainer: the `model` hook registers a forward pre-hook on
the policy head that keeps its input when it carries a gradient (the minibatch forwards, not the no-grad
rollout), and the `loss` hook consumes it. The directions come from a counter-seeded generator, so a run
is deterministic and `copy.deepcopy` branches it completely (the kept features are never copied).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from ray import tune
from stabench.suite.api import Stabilizer
from torch import nn

N_DIRECTIONS = 16
T_POINTS = torch.linspace(-5.0, 5.0, 8)


def isotropic_gaussian_loss(features: torch.Tensor, directions: torch.Tensor,
                            t: torch.Tensor = T_POINTS) -> torch.Tensor:
    """Squared distance between the empirical characteristic function of each projection and exp(-t^2/2).

    `features` is batch x d, `directions` d x M (unit columns), `t` the points; returns a scalar averaged over
    directions and points.
    """
    proj = features @ directions  # batch x M
    tz = proj.unsqueeze(-1) * t.to(features.dtype)  # batch x M x P
    real = torch.cos(tz).mean(0)
    imag = torch.sin(tz).mean(0)
    target = torch.exp(-0.5 * t.to(features.dtype) ** 2)
    return ((real - target) ** 2 + imag**2).mean()


def random_directions(dim: int, m: int, generator: torch.Generator) -> torch.Tensor:
    """`m` random unit vectors in R^dim as the columns of a dim x m matrix."""
    u = torch.randn(dim, m, generator=generator)
    return u / u.norm(dim=0, keepdim=True)


class FeatureTap:
    """A forward pre-hook that keeps the input of the module it is registered on, when it carries a gradient.

    Deep copies start empty: a kept tensor belongs to one autograd graph and is consumed by the next `loss`.
    """

    def __init__(self) -> None:
        self.features: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        z = args[0]
        if isinstance(z, torch.Tensor) and z.requires_grad:
            self.features = z

    def take(self) -> torch.Tensor | None:
        z, self.features = self.features, None
        return z

    def __deepcopy__(self, memo: dict[int, Any]) -> FeatureTap:
        return FeatureTap()


class IsotropicGaussian(Stabilizer):
    """lam x the isotropic Gaussian characteristic-function loss on the policy head's input, per minibatch."""

    name = "isotropic-gaussian"
    trainers = frozenset({"ppo"})  # it taps the `policy` head of the PPO tasks' actor-critic
    lam: float = 5.0
    search_space = {"lam": tune.loguniform(0.2, 25.0)}  # the weights tried on version 1 of primacy-bias, 0.2 to 25
    n_directions: int = N_DIRECTIONS
    seed: int = 0

    def __init__(self) -> None:
        self.tap = FeatureTap()
        self.calls = 0

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        head = getattr(model, "policy", None)
        if not isinstance(head, nn.Module):
            raise TypeError("isotropic-gaussian needs an actor-critic with a `policy` head module")
        head.register_forward_pre_hook(self.tap)
        return model

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        z = self.tap.take()
        if z is None:
            return terms
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.calls)
        self.calls += 1
        directions = random_directions(z.shape[-1], self.n_directions, generator).to(z.dtype)
        terms = dict(terms)
        terms["isotropic"] = self.lam * isotropic_gaussian_loss(z.reshape(-1, z.shape[-1]), directions)
        return terms
