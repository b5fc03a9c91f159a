"""Entropy control: the entropy bonus (one implementation for every trainer, two named settings), and Clip-Cov and
KL-Cov, which restrain the few tokens whose covariance drives the entropy down (below).

The entropy bonus: the loss gains a term  -coef * sum_t w_t H(pi_theta(. | s_t)),  with H the exact per-action
entropy carrying the graph (`batch["entropy"]`) and w the trainer's aggregation weights (`token_weight`): it is added to
whatever entropy term the trainer has (PPO's own ent_coef 0.01; none in GRPO and tool-PPO; 0 in token-PPO).
It keeps the policy from committing whatever the advantages say, without touching anything else, which is
why it is the plain guard most fixes are ablated against: if it does as well as a fix, the failure ran
through entropy.

- `entropy-bonus`: coef 0.05.
- `entropy-bonus-low`: coef 0.01 (a weak guard: on missing-critic a strong bonus holds the policy near
  uniform and fails the control too, so only a weak one measures what entropy alone does there).

Covariance-based entropy control (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617): under a policy gradient the entropy falls by about the covariance of log pi
and the advantage (their entropy-dynamics theorem for policy gradient), so instead of a bonus on every token they
restrain the few tokens with the largest centred covariance term, per token over the update's real tokens (logp
detached),

    cov_t = (logp_t - mean logp) (A_t - mean A)        (the authors' code and verl: `cov_all`, `cov_lst_all`).

Their loss is the unclipped surrogate -A r, r = exp(logp - anchor_logp), with (the paper's Clip-Cov and KL-Cov
definitions; the defaults of its experimental setup as the authors' released scripts set them):

- `clip-cov`: floor(rho N) tokens drawn at random among those whose cov lies in (omega_low, omega_high) (and that
  the ratio clip does not already hold) lose their gradient (their term is multiplied by 0),
  l_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) (1 - 1[t selected]). Defaults (the authors'
  `recipe/dapo/7b_clip_cov.sh`: clip_cov_ratio, clip_cov_lb, clip_cov_ub, clip_ratio): rho = 2e-4,
  (omega_low, omega_high) = (1, 5), and the ratio clip widened to eps_low = eps_high = 1 (clip(r, 0, 2): the
  paper's Clip-Cov replaces PPO's clip). At least one token is selected when any lies in the band, as verl's
  `compute_policy_loss_clip_cov` does (max(int(rho N), 1)): with the suite's minibatches (a few hundred tokens)
  floor(2e-4 N) is 0, so the paper's rate would select nothing at all, and one token per update is already a
  larger share (1/N, about 0.1-1%) than the paper's 2e-4. The draw uses torch's global generator (seeded per
  trial), like verl's `torch.randperm`.
- `kl-cov`: the top k N tokens by cov (at least one, as verl) get a KL penalty, l_t = -A r + beta KL_t on them,
  -A r elsewhere (no ratio clip). Defaults (`recipe/dapo/7b_kl_cov.sh`: k_percent = 0.2, in percent, and
  ppo_kl_coef): k = 2e-3 (their Qwen2.5-7B setting; 2e-4 for 32B), beta = 1, and KL_t = |log r|
  (`estimator = "abs"`: the authors' and verl's `abs_kl`; the paper writes D_KL(pi_old || pi_theta));
  `estimator = "k2"` takes (log r)^2 / 2 instead (with beta tuned for |log r|, a much weaker pull near r = 1).

Where they act: Clip-Cov drops gradients even on a batch's first update, so it acts on every policy-gradient task.
KL-Cov at r = 1 has the trainer's gradient (the penalty's gradient vanishes at log r = 0 and no clip binds), so it
needs `policy_reuse` (`suite.api.POLICY_REUSE`) and scores as the baseline on the one-step-per-batch tasks.
`clip_cov_loss` and `kl_cov_loss` are the per-token math (with the selection as an argument), comparable one to
one with verl's per-token losses before `agg_loss`; aggregation is the trainer's (`token_weight`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from ray import tune
from stabench.baselines.stabilizers.clipping import POLICY_KEYS, policy_term, token_weighted_sum
from stabench.suite.api import POLICY_REUSE, Stabilizer


def entropy_bonus(batch: Mapping[str, torch.Tensor], coef: float) -> torch.Tensor:
    """-coef * sum(token_weight * entropy): the term an entropy bonus adds to the loss."""
    return -coef * token_weighted_sum(batch["entropy"], batch)


class EntropyBonus(Stabilizer):
    name = "entropy-bonus"
    needs = frozenset({"entropy", "token_weight"})
    coef: ClassVar[float] = 0.05
    search_space = {"coef": tune.loguniform(0.001, 0.3)}  # from barely there to a policy held near uniform

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**terms, "entropy_bonus": entropy_bonus(batch, self.coef)}


class EntropyBonusLow(EntropyBonus):
    name = "entropy-bonus-low"
    coef: ClassVar[float] = 0.01


def centred_covariance(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """cov_t = (logp_t - mean logp) (A_t - mean A), the means over the real actions (`mask` > 0); logp detached.
    Padding's entries are meaningless (callers select among real actions only)."""
    real = mask > 0
    logp, advantages = logp.detach(), advantages.detach()
    return (logp - logp[real].mean()) * (advantages - advantages[real].mean())


def at_least_one(fraction: float, n: int) -> int:
    """max(int(fraction n), 1): how many of n real tokens the covariance methods restrain (verl's rule)."""
    return max(int(fraction * n), 1)


def clip_cov_candidates(logp: torch.Tensor, anchor_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        cov_low: float, cov_high: float, eps_low: float, eps_high: float) -> torch.Tensor:
    """Bool per action: real, cov strictly inside (cov_low, cov_high), and not already held by the ratio clip."""
    ratio = torch.exp(logp - anchor_logp).detach()
    held = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high) > -advantages * ratio  # verl's clip_by_origin
    cov = centred_covariance(logp, advantages, mask)
    return (mask > 0) & (cov > cov_low) & (cov < cov_high) & ~held


def choose_random(candidates: torch.Tensor, count: int) -> torch.Tensor:
    """Bool like `candidates`: `count` of them drawn uniformly without replacement (all if fewer), with torch's
    global generator, in verl's order (torch.randperm over the row-major indices of the candidates)."""
    index = torch.nonzero(candidates)
    chosen = torch.zeros_like(candidates)
    if len(index):
        index = index[torch.randperm(len(index))[:count]]
        chosen[tuple(index.T)] = True
    return chosen


def clip_cov_loss(logp: torch.Tensor, anchor_logp: torch.Tensor, advantages: torch.Tensor, selected: torch.Tensor,
                  eps_low: float, eps_high: float) -> torch.Tensor:
    """Per action max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), times 0 on the `selected` actions."""
    per_action = policy_term(torch.exp(logp - anchor_logp), advantages, eps_low, eps_high)
    return per_action * (~selected).to(per_action.dtype)


def top_covariance(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """Bool per action: the `count` real actions with the largest cov (ties by torch.topk)."""
    real = mask > 0
    cov = centred_covariance(logp, advantages, mask)
    chosen = torch.zeros_like(real)
    flat = torch.nonzero(real.reshape(-1)).squeeze(-1)
    top = torch.topk(cov.reshape(-1)[flat], min(count, len(flat))).indices
    chosen.view(-1)[flat[top]] = True
    return chosen


def kl_cov_loss(logp: torch.Tensor, anchor_logp: torch.Tensor, advantages: torch.Tensor, selected: torch.Tensor,
                coef: float, estimator: str = "abs") -> torch.Tensor:
    """Per action -A r, plus coef |log r| (or coef (log r)^2 / 2, `estimator="k2"`) on the `selected` actions."""
    log_ratio = logp - anchor_logp
    penalty = log_ratio.abs() if estimator == "abs" else 0.5 * log_ratio**2
    return -advantages * torch.exp(log_ratio) + coef * penalty * selected.to(logp.dtype)


class ClipCov(Stabilizer):
    """Clip-Cov: the gradient of floor(2e-4 N) (at least 1) random tokens with cov in (1, 5) is dropped."""

    name = "clip-cov"
    needs = POLICY_KEYS | {"mask"}  # it acts from a batch's first update on (a dropped gradient)
    fraction: ClassVar[float] = 2e-4  # rho, the share of tokens restrained (clip_cov_ratio)
    cov_low: ClassVar[float] = 1.0  # omega_low
    cov_high: ClassVar[float] = 5.0  # omega_high
    eps_low: ClassVar[float] = 1.0  # the authors' clip_ratio_low = clip_ratio_high = 1 (7b_clip_cov.sh)
    eps_high: ClassVar[float] = 1.0
    search_space = {"fraction": tune.loguniform(1e-4, 0.1), "cov_low": tune.uniform(0.0, 3.0)}

    def selected(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The actions whose gradient is dropped on this update."""
        logp, mask = batch["logp"], batch["mask"]
        candidates = clip_cov_candidates(logp, batch["anchor_logp"], batch["advantages"], mask,
                                         self.cov_low, self.cov_high, self.eps_low, self.eps_high)
        return choose_random(candidates, at_least_one(self.fraction, int((mask > 0).sum())))

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per_action = clip_cov_loss(batch["logp"], batch["anchor_logp"], batch["advantages"], self.selected(batch),
                                   self.eps_low, self.eps_high)
        return {**terms, "policy": token_weighted_sum(per_action, batch)}


class KLCov(Stabilizer):
    """KL-Cov: the top 2e-3 of tokens by cov (at least 1) pay 1 * |log r|; the surrogate is unclipped."""

    name = "kl-cov"
    needs = POLICY_KEYS | {"mask", POLICY_REUSE}  # at r = 1 its gradient is the trainer's
    fraction: ClassVar[float] = 2e-3  # k (k_percent = 0.2 %, Qwen2.5-7B)
    coef: ClassVar[float] = 1.0  # beta
    estimator: ClassVar[str] = "abs"  # the authors' |log r|; "k2": (log r)^2 / 2
    search_space = {"fraction": tune.loguniform(1e-4, 0.1), "coef": tune.loguniform(0.1, 10.0),
                    "estimator": tune.choice(["abs", "k2"])}

    def selected(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The actions that pay the KL penalty on this update."""
        mask = batch["mask"]
        return top_covariance(batch["logp"], batch["advantages"], mask, at_least_one(self.fraction,
                                                                                    int((mask > 0).sum())))

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per_action = kl_cov_loss(batch["logp"], batch["anchor_logp"], batch["advantages"], self.selected(batch),
                                 self.coef, self.estimator)
        return {**terms, "policy": token_weighted_sum(per_action, batch)}
