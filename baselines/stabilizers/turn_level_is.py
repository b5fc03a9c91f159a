"""Off-policy corrections for the multi-turn token trainer (baselines/tool_ppo.py).

Notation, per policy token t of turn k: q the sampler that wrote it (its stored `behaviour_logp`), pi_old
the learner at the start of the update (`old_logp`, recomputed by the trainer), pi_theta the policy being
optimized (`logp`, with grad), A the advantage, eps_l / eps_h the clip range, m_t the token weights of the
trainer's token mean. The trainer's own term (what an asynchronous pipeline that reuses the engine's
log-probs computes) is  L = sum_t m_t max(-A r_t, -A clip(r_t, 1 - eps_l, 1 + eps_h)),  r_t = pi_theta / q.

- `TurnLevelIS` ("turn-is", after SORL / ST-PPO, Li et al. 2025): the sampler's off-policyness is corrected
  once per turn, by the turn's truncated likelihood ratio (the turn is the action the tool answers):
    w_k  = min(prod_{t in k} pi_old / q, C), C = 2                  (turn-level truncated IS, detached)
    r'_t = pi_theta / pi_old                                        (token-level trust region)
    s_t  = max(-A r'_t, -A clip(r'_t, 1 - eps_l, 1 + eps_h))
  Clipping-triggered normalization (our reading of the paper's clipping-bias correction, whose exact formula
  is not public in code): the minibatch's clipping bias b = sum_t m_t |r'_t - clip(r'_t)| (zero until the
  clip triggers) scales the step down, highly off-policy minibatches counting less:
    L = sum_t m_t w_k s_t / (1 + sg(b)).
  Options: `geometric = True` takes SORL's geometric mean exp(mean_{t in k} log(pi_old / q)) for w_k instead
  of the product; `turn_ratio = True` also puts the trust region at the turn level, r'_t = exp(mean_{t in k}
  log(pi_theta / pi_old)) (SORL's Turn-PPO ratio). Both measured worse on rare-tool-states (task docstring).
- `TokenTIS` ("token-tis", the token-level ablation: decoupled PPO / verl's truncated importance
  sampling): r'_t = pi_theta / pi_old, w_t = min(pi_old / q, C) detached, L = sum_t m_t w_t
  max(-A r'_t, -A clip(r'_t)). It tells whether the turn-level granularity matters: on rare-tool-states
  (version 3) it does not, and token-tis is that task's matched fix (turn-is fails more often there).
- `ToolDualClip` ("tool-dual-clip", Ye et al. 2020; the plain guard): the trainer's ratio r_t = pi_theta / q,
  and on negative advantages the term is bounded by -c A, c = 3:
  L = sum_t m_t (A < 0 ? min(max(-A r, -A clip(r)), -c A) : max(-A r, -A clip(r))).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from suite.api import Stabilizer


def clipped_term(ratio: torch.Tensor, adv: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per-token negative clipped objective max(-A r, -A clip(r, 1 - low, 1 + high))."""
    return torch.max(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))


def turn_mean(values: torch.Tensor, turn: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the masked tokens of each (episode, turn), broadcast back to its tokens: [b, P]."""
    n_turns = int(turn.max()) + 1
    onehot = torch.nn.functional.one_hot(turn, n_turns).to(values.dtype) * mask[..., None]  # [b, P, K]
    sums = (values[..., None] * onehot).sum(1)  # [b, K]
    counts = onehot.sum(1).clamp_min(1)
    return ((sums / counts)[:, None, :] * onehot).sum(-1)


def turn_size(turn: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Number of masked tokens in each token's (episode, turn), broadcast to its tokens: [b, P]."""
    onehot = torch.nn.functional.one_hot(turn, int(turn.max()) + 1).to(mask.dtype) * mask[..., None]
    return (onehot.sum(1)[:, None, :] * onehot).sum(-1)


class TurnLevelIS(Stabilizer):
    name = "turn-is"
    trainers = frozenset({"tool-ppo"})
    max_weight: float = 2.0  # C
    geometric: bool = False  # True: the turn weight is the geometric mean of the token ratios (SORL's turn ratio)
    turn_ratio: bool = False  # True: the trust-region ratio at the turn level too (SORL's Turn-PPO ratio)

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mask, turn, weights = batch["mask"], batch["turn"], batch["token_weight"]
        low, high = batch["clip_low"], batch["clip_high"]
        log_ratio = batch["logp"] - batch["old_logp"]
        rho = torch.exp(turn_mean(log_ratio, turn, mask) if self.turn_ratio else log_ratio)
        log_w = turn_mean(batch["old_logp"] - batch["behaviour_logp"], turn, mask)
        if not self.geometric:
            log_w = log_w * turn_size(turn, mask)  # mean x count = the turn's summed log-ratio: a product of ratios
        weight = torch.exp(log_w).clamp(max=self.max_weight).detach()
        per_token = clipped_term(rho, batch["advantages"], low, high)
        bias = ((rho - rho.clamp(1 - low, 1 + high)).abs() * weights).sum().detach()  # 0 until clipping triggers
        terms["policy"] = (weight * per_token * weights).sum() / (1 + bias)
        return terms


class TokenTIS(Stabilizer):
    name = "token-tis"
    trainers = frozenset({"tool-ppo"})
    max_weight: float = 2.0  # C

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weight = torch.exp(batch["old_logp"] - batch["behaviour_logp"]).clamp(max=self.max_weight).detach()
        ratio = torch.exp(batch["logp"] - batch["old_logp"])
        per_token = clipped_term(ratio, batch["advantages"], batch["clip_low"], batch["clip_high"])
        terms["policy"] = (weight * per_token * batch["token_weight"]).sum()
        return terms


class ToolDualClip(Stabilizer):
    name = "tool-dual-clip"
    trainers = frozenset({"tool-ppo"})
    c: float = 3.0

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        adv = batch["advantages"]
        ratio = torch.exp(batch["logp"] - batch["behaviour_logp"])
        per_token = clipped_term(ratio, adv, batch["clip_low"], batch["clip_high"])
        per_token = torch.where(adv < 0, torch.min(per_token, -self.c * adv), per_token)
        terms["policy"] = (per_token * batch["token_weight"]).sum()
        return terms
