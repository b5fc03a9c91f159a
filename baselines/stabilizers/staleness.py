"""Off-policy corrections for stale (lagged-actor) PPO data: decoupled PPO, V-trace, dual clip.

Notation, per sample: pi_b the behaviour policy that collected the action (its log-probability is the
stored `logprobs`), pi_old the learner at the start of the update (`old_logprobs`; equal to `logprobs`
when the actor is the learner), pi_theta the policy being optimized (`new_logprobs`, with grad), A the
advantage the trainer's policy term uses (`adv`), eps the clip coefficient (`clip_coef`). The trainer's
own policy term (classic asynchronous PPO) is  L = -mean(min(r A, clip(r, 1 - eps, 1 + eps) A)),
r = pi_theta / pi_b.

- `DecoupledPPO` (Hilton et al. 2022; verl's truncated importance sampling): the trust region is taken
  around pi_old, and the off-policyness is corrected by a detached, truncated weight,
  L = -mean(w * min(r' A, clip(r', 1 - eps, 1 + eps) A)),  r' = pi_theta / pi_old,  w = min(pi_old / pi_b, C),
  C = 2.
- `VTrace` (Espeholt et al. 2018, IMPALA): once per iteration (the PPO `rollout` hook) the value targets
  and advantages are recomputed with truncated importance weights rho_t = min(pi_old / pi_b, 1) and
  c_t = lambda min(pi_old / pi_b, 1):
  v_t = V_t + delta_t + gamma c_t (v_{t+1} - V_{t+1}),  delta_t = rho_t (r_t + gamma V_{t+1} - V_t),
  A_t = rho_t (r_t + gamma v_{t+1} - V_t), with episode ends cutting the recursion as in the trainer's GAE
  and V the learner's values. The critic regresses on v_t, and the policy term is the clipped surrogate
  around pi_old: L = -mean(min(r' A, clip(r', 1 - eps, 1 + eps) A)).
- `DualClip` (Ye et al. 2020): on negative advantages the objective is bounded below by c A, c = 3:
  L = -mean(A < 0 ? max(min(r A, clip(r) A), c A) : min(r A, clip(r) A)), with the trainer's own ratio
  r = pi_theta / pi_b. Usable by any PPO-based task.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from suite.api import Stabilizer


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps: torch.Tensor | float) -> torch.Tensor:
    """Per-sample PPO loss max(-A r, -A clip(r, 1 - eps, 1 + eps)) (the negative clipped objective)."""
    return torch.max(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))


class DecoupledPPO(Stabilizer):
    name = "decoupled-ppo"
    trainers = frozenset({"ppo"})
    max_weight: float = 2.0  # C

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weight = torch.exp(batch["old_logprobs"] - batch["logprobs"]).clamp(max=self.max_weight).detach()
        ratio = torch.exp(batch["new_logprobs"] - batch["old_logprobs"])
        terms["policy"] = (weight * clipped_surrogate(ratio, batch["adv"], batch["clip_coef"])).mean()
        return terms


def vtrace(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, next_value: torch.Tensor,
           next_done: torch.Tensor, log_rho: torch.Tensor, gamma: float, lam: float,
           rho_bar: float = 1.0, c_bar: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets and policy-gradient advantages over a T x N rollout (CleanRL's done convention:
    `dones[t]` marks that obs t starts a new episode). Returns (targets v_t, advantages A_t), both T x N."""
    T = rewards.shape[0]
    rho = torch.exp(log_rho)
    rho_t, c_t = rho.clamp(max=rho_bar), lam * rho.clamp(max=c_bar)
    vs = torch.zeros_like(values)
    adv = torch.zeros_like(values)
    acc = torch.zeros_like(next_value)  # v_{t+1} - V_{t+1}
    for t in reversed(range(T)):
        if t == T - 1:
            nonterminal, v_next = 1.0 - next_done, next_value
        else:
            nonterminal, v_next = 1.0 - dones[t + 1], values[t + 1]
        delta = rho_t[t] * (rewards[t] + gamma * v_next * nonterminal - values[t])
        acc = delta + gamma * c_t[t] * nonterminal * acc
        vs[t] = values[t] + acc
    for t in range(T):
        if t == T - 1:
            nonterminal, vs_next = 1.0 - next_done, next_value
        else:
            nonterminal, vs_next = 1.0 - dones[t + 1], vs[t + 1]
        adv[t] = rho_t[t] * (rewards[t] + gamma * vs_next * nonterminal - values[t])
    return vs, adv


class VTrace(Stabilizer):
    name = "vtrace"
    trainers = frozenset({"ppo"})

    def rollout(self, batch: dict[str, torch.Tensor], info: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        T, N = info["num_steps"], info["num_envs"]

        def grid(key: str) -> torch.Tensor:
            return batch[key].reshape(T, N)

        vs, adv = vtrace(grid("rewards"), grid("values"), grid("dones"), info["next_value"], info["next_done"],
                         grid("old_logprobs") - grid("logprobs"), info["gamma"], info["gae_lambda"])
        return {**batch, "returns": vs.reshape(-1), "advantages": adv.reshape(-1)}

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ratio = torch.exp(batch["new_logprobs"] - batch["old_logprobs"])
        terms["policy"] = clipped_surrogate(ratio, batch["adv"], batch["clip_coef"]).mean()
        return terms


class DualClip(Stabilizer):
    name = "dual-clip"
    trainers = frozenset({"ppo"})
    c: float = 3.0

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        adv = batch["adv"]
        ratio = torch.exp(batch["new_logprobs"] - batch["logprobs"])
        per_sample = clipped_surrogate(ratio, adv, batch["clip_coef"])
        per_sample = torch.where(adv < 0, torch.min(per_sample, -self.c * adv), per_sample)
        terms["policy"] = per_sample.mean()
        return terms
