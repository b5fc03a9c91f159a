"""Importance-sampling corrections for actions another policy sampled (a stale actor, an inference engine).

Notation, per action: q (`behaviour_logp`) the policy that really sampled it (the lagged actor, the sampler);
pi_old (`old_logp`) the learner at the start of the update; pi_theta (`logp`, with grad) the policy being
optimized; A the advantage; w the trainer's aggregation weights. Every trainer's own term is the clipped
surrogate against its anchor (`anchor_logp`), s = max(-A r, -A clip(r)) (`clipping.policy_term`): in PPO and
tool-PPO r = pi_theta / q, what an asynchronous pipeline that reuses the stored log-probs computes; in GRPO
and token-PPO r = pi_theta / pi_old, the learner's recomputed log-probs, so a sampler that differs from the
learner (an inference engine) goes uncorrected. Where the learner sampled, q = pi_old and the corrections
below reduce to the trainer's term: they act only on tasks that provide `behaviour_policy` (`suite.api`; tool-PPO's
engine, and the tasks with a sampler of their own), and elsewhere their runs are the baseline's.

- `token-tis` (decoupled PPO, Hilton et al. 2022; verl's token-level truncated importance sampling): the
  trust region around pi_old, the off-policyness corrected by a detached, truncated weight per action,
      L = sum_t w_t min(pi_old / q, C) max(-A r', -A clip(r')),   r' = pi_theta / pi_old,   C = 2.
- `seq-tis` (sequence-level truncated IS, verl's `seq_is`): the same trust region with one detached weight
  per answer, the truncated product of its token ratios, w_i = min(prod_t pi_old / q, C), C = 2 (on a step
  rollout each action is its own sequence: token-tis).
- `token-mis` (masked IS, Liu, Li et al. 2025, "When Speed Kills Stability"): token-tis with the cap made a
  mask, a token whose ratio is implausible dropped instead of kept at C,
      L = sum_t w_t m_t max(-A r', -A clip(r')),   m_t = pi_old / q if pi_old / q <= C else 0,   C = 2.
  A masked token still counts in the aggregation's denominator (`token_weighted_sum` keeps its w_t), so
  masking scales the step down; the same holds for the two below.
- `seq-mis` (sequence-level masked IS, verl's `seq_mis`): the mask on the answer's product of token ratios,
  m_i = rho_i if rho_i <= C else 0 on every token of answer i, rho_i = prod_t pi_old / q, C = 2: an answer
  seq-tis would keep at C is dropped whole (on a step rollout: token-mis).
- `geo-mis` (geometric sequence masking, verl's `geo_rs`): answer i is dropped whole when the geometric mean
  of its token ratios, g_i = exp(mean_t log(pi_old / q)), leaves [1 / C_g, C_g], C_g = 1.25; the tokens of a
  kept answer keep token-tis's weight min(pi_old / q, C), C = 2. Length-normalized: unlike seq-mis it does
  not drop a long answer for its length alone.
- `turn-is` (after SORL / ST-PPO, Li et al. 2025; multi-turn trainers): the sampler's off-policyness corrected
  once per turn, by the turn's truncated likelihood ratio (the turn is the action the tool answers):
      w_k  = min(prod_{t in k} pi_old / q, C), C = 2                  (turn-level truncated IS, detached)
      r'_t = pi_theta / pi_old                                        (token-level trust region)
  and clipping-triggered normalization (our reading of the paper's clipping-bias correction, whose exact
  formula is not public in code): the minibatch's clipping bias b = sum_t w_t |r'_t - clip(r'_t)| (zero
  until the clip triggers) scales the step down, L = sum_t w_t w_k s_t / (1 + sg(b)). Options:
  `geometric = True` takes SORL's geometric mean for w_k; `turn_ratio = True` puts the trust region at the
  turn level too (SORL's Turn-PPO ratio). Both measured worse on rare-tool-states (that task's docstring).
- `vtrace` (Espeholt et al. 2018, IMPALA; step-wise rollouts with a critic, PPO): once per iteration (the
  `rollout` hook) value targets and advantages are recomputed with truncated importance weights
  rho_t = min(pi_old / q, 1) and c_t = lambda min(pi_old / q, 1):
      v_t = V_t + delta_t + gamma c_t (v_{t+1} - V_{t+1}),  delta_t = rho_t (r_t + gamma V_{t+1} - V_t),
      A_t = rho_t (r_t + gamma v_{t+1} - V_t),
  episode ends cutting the recursion as in the trainer's GAE, V the learner's values. The critic regresses
  on v_t, and the policy term is the clipped surrogate around pi_old: sum_t w_t max(-A r', -A clip(r')).
- `icepop` (IcePop, Ring-1T, "Every Step Evolves", arXiv 2510.18855, the IcePop objective): token-mis with a
  two-sided band, the train/inference ratio k = pi_old / q kept only inside [alpha, beta],
      L = sum_t w_t M(k_t) max(-A r', -A clip(r')),   M(k) = k if alpha <= k <= beta else 0,
  alpha = 0.5, beta = 5 (the Ring-1T report's and IcePop blog's bounds; we could not read the report's settings
  table itself). It is `TokenMIS` with a floor: the same weight, term and aggregation, beta in place of C.
- `m2po` (M2PO, Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161; AReaL's `m2_threshold`): the
  trust region of stale data is the second moment of the log-ratio to the behaviour policy, not a clip. Per
  update, over the minibatch's real tokens with log rho_t = logp_t - log q_t (pi_theta detached, as the paper's
  M2 = mean (log pi_theta / pi_behav)^2), the tokens with the largest (log rho)^2 are masked, largest first, until
  the mean over the rest is below tau (if none is, one token stays, as AReaL); then
      L = sum_t w_t m_t (-A_t rho_t),   rho_t = pi_theta / q (unclipped),   tau = 0.04
  (the paper's tau_M2; AReaL's `examples/math/gsm8k_m2po.yaml`, `m2_threshold: 0.04`). A masked token keeps its
  w_t in the denominator (AReaL keeps the unmasked count). With pi_theta = pi_old = q it is the trainer's first
  update, but it replaces the clip on every later one, so, like the corrections above, it acts only where
  something else samples (`behaviour_policy`), the setting it was made for. AReaL computes the mask once per
  micro-batch loss call against its recomputed pi_old; here the loss hook sees the update's minibatch and the
  current pi_theta (equal to pi_old on its first update).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from ray import tune
from stabench.baselines.stabilizers.clipping import POLICY_KEYS, policy_term, token_weighted_sum
from stabench.suite.api import BEHAVIOUR_POLICY, Stabilizer


class TokenTIS(Stabilizer):
    name = "token-tis"
    needs = POLICY_KEYS | {"old_logp", "behaviour_logp", BEHAVIOUR_POLICY}  # where the learner sampled: identity
    max_weight: float = 2.0  # C
    search_space = {"max_weight": tune.loguniform(1.0, 10.0)}  # C: from no up-weighting to a loose cap

    def log_weight(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """log(pi_old / q) per action, before truncation."""
        return batch["old_logp"] - batch["behaviour_logp"]

    def weight(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The weight per action (detached by `loss`): min(exp(log_weight), C)."""
        return torch.exp(self.log_weight(batch)).clamp(max=self.max_weight)

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weight = self.weight(batch).detach()
        ratio = torch.exp(batch["logp"] - batch["old_logp"])
        per_action = policy_term(ratio, batch["advantages"], batch["clip_low"], batch["clip_high"])
        return {**terms, "policy": token_weighted_sum(weight * per_action, batch)}


class SequenceTIS(TokenTIS):
    name = "seq-tis"
    needs = TokenTIS.needs | {"mask"}

    def log_weight(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The answer's summed log-ratio on every one of its tokens (a step rollout: each action its own)."""
        log_w = (batch["old_logp"] - batch["behaviour_logp"]) * batch["mask"]
        return log_w.sum(-1, keepdim=True) if log_w.dim() > 1 else log_w


class TokenMIS(TokenTIS):
    name = "token-mis"

    def weight(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """exp(log_weight) where it is at most C, else 0: the action is masked instead of truncated."""
        w = torch.exp(self.log_weight(batch))
        return torch.where(w <= self.max_weight, w, torch.zeros_like(w))


class SequenceMIS(SequenceTIS, TokenMIS):
    name = "seq-mis"  # SequenceTIS's log_weight (the answer's summed log-ratio), TokenMIS's mask


def band_weight(log_weight: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """IcePop's M(k): k = exp(log_weight) where low <= k <= high, else 0 (per action)."""
    k = torch.exp(log_weight)
    return torch.where((k >= low) & (k <= high), k, torch.zeros_like(k))


class IcePop(TokenMIS):
    """token-mis with a floor: pi_old / q kept inside [0.5, 5], the token masked outside (see the module)."""

    name = "icepop"
    min_weight: float = 0.5  # alpha
    max_weight: float = 5.0  # beta
    search_space = {"min_weight": tune.uniform(0.1, 0.9), "max_weight": tune.loguniform(1.5, 20.0)}

    def weight(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """M(pi_old / q): the ratio where it lies in [alpha, beta], else 0."""
        return band_weight(self.log_weight(batch), self.min_weight, self.max_weight)


def m2po_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool per action: the real actions M2PO keeps. The real actions' (log_ratio)^2 sorted in decreasing order, the
    largest are dropped until the mean of the rest is below `threshold` (at least one kept), as AReaL's
    `_get_m2po_loss_mask`; padding is never kept."""
    real = mask > 0
    second = log_ratio.detach()[real] ** 2
    keep = torch.zeros_like(real)
    if second.numel() == 0:
        return keep
    ordered, order = torch.sort(second, descending=True)
    rest_mean = ordered.flip(0).cumsum(0).flip(0) / torch.arange(len(ordered), 0, -1, dtype=ordered.dtype)
    below = torch.nonzero(rest_mean < threshold)
    dropped = int(below[0]) if len(below) else len(ordered) - 1
    kept = torch.ones_like(ordered, dtype=torch.bool)
    kept[:dropped] = False
    keep[real] = kept[torch.argsort(order)]
    return keep


def m2po_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              threshold: float) -> torch.Tensor:
    """Per action -A rho m, rho = exp(logp - behaviour_logp) unclipped, m = `m2po_mask` of log rho."""
    log_ratio = logp - behaviour_logp
    keep = m2po_mask(log_ratio, mask, threshold).to(logp.dtype)
    return -advantages * torch.exp(log_ratio) * keep


class M2PO(Stabilizer):
    """M2PO: the unclipped ratio to the behaviour policy, the largest (log rho)^2 masked until their mean < 0.04."""

    name = "m2po"
    needs = POLICY_KEYS | {"behaviour_logp", "mask", BEHAVIOUR_POLICY}  # stale or engine-sampled data only
    threshold: float = 0.04  # tau_M2
    search_space = {"threshold": tune.loguniform(0.005, 0.5)}

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per_action = m2po_loss(batch["logp"], batch["behaviour_logp"], batch["advantages"], batch["mask"],
                               self.threshold)
        return {**terms, "policy": token_weighted_sum(per_action, batch)}


class GeometricMIS(TokenTIS):
    name = "geo-mis"
    needs = TokenTIS.needs | {"mask"}
    geo_bound: float = 1.25  # C_g: an answer is kept while its geometric-mean ratio lies in [1 / C_g, C_g]
    search_space = {"max_weight": tune.loguniform(1.0, 10.0), "geo_bound": tune.loguniform(1.01, 3.0)}

    def weight(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """min(pi_old / q, C) per token, 0 on every token of an answer whose mean log-ratio leaves
        [-log C_g, log C_g] (a step rollout: each action its own answer)."""
        log_w = self.log_weight(batch)
        if log_w.dim() > 1:
            mask = batch["mask"]
            log_g = (log_w * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
        else:
            log_g = log_w
        w = torch.exp(log_w).clamp(max=self.max_weight)
        return torch.where(log_g.abs() <= math.log(self.geo_bound), w, torch.zeros_like(w))


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
    needs = POLICY_KEYS | {"old_logp", "behaviour_logp", "turn", "mask", BEHAVIOUR_POLICY}
    max_weight: float = 2.0  # C
    search_space = {"max_weight": tune.loguniform(1.0, 10.0)}
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
        per_token = policy_term(rho, batch["advantages"], low, high)
        bias = ((rho - rho.clamp(1 - low, 1 + high)).abs() * weights).sum().detach()  # 0 until clipping triggers
        return {**terms, "policy": token_weighted_sum(weight * per_token, batch) / (1 + bias)}


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
    needs = POLICY_KEYS | {"old_logp", "behaviour_logp", "values", "returns", "rewards", "dones"}

    def rollout(self, batch: dict[str, torch.Tensor], info: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        T, N = info["num_steps"], info["num_envs"]

        def grid(key: str) -> torch.Tensor:
            return batch[key].reshape(T, N)

        vs, adv = vtrace(grid("rewards"), grid("values"), grid("dones"), info["next_value"], info["next_done"],
                         grid("old_logp") - grid("behaviour_logp"), info["gamma"], info["gae_lambda"])
        return {**batch, "returns": vs.reshape(-1), "advantages": adv.reshape(-1)}

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ratio = torch.exp(batch["logp"] - batch["old_logp"])
        per_action = policy_term(ratio, batch["advantages"], batch["clip_low"], batch["clip_high"])
        return {**terms, "policy": token_weighted_sum(per_action, batch)}
