"""CHAIN value-churn reduction (Tang & Berseth 2024, "Improving Deep RL by Reducing the Chain Effect of
Value and Policy Churn"): the matched fix of the `policy-churn` task.

    L = L_TD + lambda * MSE(Q_theta(s_ref, .), Q_prev(s_ref, .))

over all actions, with s_ref the trainer's independent reference replay sample (`batch["ref_obs"]`, never
in the TD batch) and Q_prev the network's parameters one update back. The regularizer penalizes how much
the last update changed Q outside its own batch, and pulls that change back.

The `model` hook keeps a reference to the trainer's network and a frozen copy; each `loss` call evaluates
the copy (Q_prev) on s_ref, then overwrites the copy with the current parameters, which the coming optimizer
step is about to change: at the next call the copy is exactly one update back. On the first call Q_prev
equals Q_theta and the regularizer is zero. The copy lives inside the stabilizer, which lives inside the
trainer, so `copy.deepcopy` of a run branches it along with the network.

lambda: automatic by default (`auto = True`, the paper's rule) lambda = beta * mean|L_TD| / mean(L_reg), with
running means over all updates so far (beta 0.05, the paper's DDQN value; its code starts from a fixed 100
and switches to the rule after 10,000 updates, far more than a run here has), or fixed (`auto = False`, `lam`).

Measured on `policy-churn` (see that task): in the healthy regime CHAIN lowers per-update policy churn
(0.04-0.06 vs 0.07-0.09) and raises the return a little; it does not prevent the collapse a learning-rate
shock causes there, which runs through saturated units rather than churn.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from suite.api import Stabilizer


def chain_regularizer(q: torch.Tensor, q_prev: torch.Tensor) -> torch.Tensor:
    """MSE over states and actions between Q_theta and the (detached) Q_prev on the reference batch."""
    return (q - q_prev.detach()).pow(2).mean()


class Chain(Stabilizer):
    name = "chain"
    trainers = frozenset({"dqn"})
    lam: float = 1.0
    auto: bool = True
    beta: float = 0.05

    def __init__(self) -> None:
        self.net: nn.Module | None = None
        self.prev: nn.Module | None = None
        self.main_sum = 0.0
        self.reg_sum = 0.0

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        self.net = model
        self.prev = copy.deepcopy(model).requires_grad_(False)
        return model

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert self.net is not None and self.prev is not None, "Chain.model must be called before Chain.loss"
        ref = batch["ref_obs"]
        with torch.no_grad():
            q_prev = self.prev(ref)
            for p_prev, p in zip(self.prev.parameters(), self.net.parameters()):
                p_prev.copy_(p)  # theta_t, about to become one update back
        reg = chain_regularizer(self.net(ref), q_prev)
        lam = self.lam
        if self.auto:
            self.main_sum += float(terms["td"].detach().abs())
            self.reg_sum += float(reg.detach())
            lam = self.beta * self.main_sum / self.reg_sum if self.reg_sum > 0 else 0.0
        return {**terms, "chain": lam * reg}
