"""How the policy term is aggregated and baselined: against the length bias of per-sequence normalization.

Per-sequence normalization (GRPO's `aggregation="seq-mean"`) weighs answer i's tokens by 1 / (N |o_i|):

    L = -(1/N) sum_i A_i (1/|o_i|) sum_t log pi(o_i,t).

With A_i < 0 (a wrong answer under a baseline that leaves negative advantages, e.g. the batch mean on a
prompt nobody can solve) the push-down on a long answer is diluted by its length: minimizing L rewards
length (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO).

- `constant-norm`: the trainer's policy term aggregated with a constant, sum_{i,t} s_i,t mask_i,t / (N L_max):
  every action weighs the same whatever the length of its answer, so the objective is the unbiased policy
  gradient up to a constant factor. Only the aggregation changes (the KL term keeps the trainer's). Where the
  trainer already takes a plain mean over fixed-length batches (PPO), it is the trainer's own term.
- `dr-grpo`: constant normalization plus the group-mean baseline without std division, A_i = R_i - mean_group R
  (Dr. GRPO). A group whose rewards are all equal then gets A = 0 and no length pressure at all. Needs groups.
- `variance-filter` (DAPO's dynamic-sampling filter, without the resampling): a group whose rewards are all
  equal (all correct or all wrong) carries no comparison, so it leaves the batch: every term (the policy
  term and the KL term) is aggregated over the other groups' actions only, their weights rescaled to the
  trainer's total, w'_i = w_i 1[Var_group(R) > 0] sum_j w_j / sum_j w_j 1[Var_group(R) > 0]. A batch of
  degenerate groups makes no update. DAPO also resamples prompts until the batch is full; that costs
  sampling and is left to the task's budget.
- `difficulty-filter` (filtering prompts by estimated difficulty, seed 002): the variance filter, and also
  every group whose success rate (its mean reward) is at most 1/8: a problem the policy nearly never solves
  leaves the batch, so its rare lucky successes teach nothing. The group itself is the difficulty estimate
  (k samples of one prompt); the same weight rescaling as the variance filter.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from stabench.baselines.stabilizers.clipping import POLICY_KEYS, policy_term, trainer_ratio
from stabench.suite.api import Stabilizer
from stabench.suite.diagnostics import group_means, live_groups


def constant_normalized_policy_loss(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The trainer's clipped policy term, sum(per_action * mask) / mask.numel()."""
    per_action = policy_term(trainer_ratio(batch), batch["advantages"], batch["clip_low"], batch["clip_high"])
    mask = batch["mask"]
    return (per_action * mask).sum() / mask.numel()


def group_centred(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """R_i - mean over i's group of R: [B] from per-answer rewards and group indices."""
    return rewards - group_means(rewards, group)[group]


ADV_EPS = 1e-4  # GRPO's default `GRPOConfig.adv_eps`


def group_normalized(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """GRPO's advantage of stabilizers that recompute the reward: (R - mean_group R) / (std_group R + ADV_EPS)
    per answer, groups given by an index per answer, the std unbiased as in GRPO (0 for a group of one)."""
    centred = group_centred(rewards, group)
    n = int(group.max()) + 1
    count = torch.zeros(n, dtype=rewards.dtype).index_add_(0, group, torch.ones_like(rewards))
    var = torch.zeros(n, dtype=rewards.dtype).index_add_(0, group, centred**2) / (count - 1).clamp_min(1)
    return centred / (var.sqrt()[group] + ADV_EPS)


class ConstantNorm(Stabilizer):
    """Constant normalization of the policy term (the unbiased token aggregation of Dr. GRPO)."""

    name = "constant-norm"
    needs = POLICY_KEYS | {"mask"}

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**terms, "policy": constant_normalized_policy_loss(batch)}


class DrGRPO(ConstantNorm):
    """Dr. GRPO: A_i = R_i - mean_group R (no std division), and constant normalization of the policy term."""

    name = "dr-grpo"
    needs = ConstantNorm.needs | {"group", "rewards"}

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        centred = group_centred(batch["rewards"].float(), batch["group"])
        return centred[:, None] * batch["mask"]


class VarianceFilter(Stabilizer):
    """Zero-variance groups leave every term; the rest keep the trainer's total weight (see the module)."""

    name = "variance-filter"
    needs = POLICY_KEYS | {"rewards", "group", "mask"}

    def kept_groups(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[n_groups] bool: the groups that stay in the batch."""
        return live_groups(batch["rewards"], batch["group"])

    def _rescale(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Per-action factor f with w' = f * w: 0 on dropped groups, sum(w) / sum(kept w) elsewhere."""
        keep = self.kept_groups(batch)[batch["group"]].float()
        weights = batch["token_weight"]
        keep = keep.view(-1, *([1] * (weights.dim() - 1))).expand_as(weights)
        kept = (weights * keep).sum()
        if float(kept) == 0.0:
            return torch.zeros_like(weights)
        return keep * weights.sum() / kept

    def kl_loss(self, kl: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return kl * self._rescale(batch)

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        per_action = policy_term(trainer_ratio(batch), batch["advantages"], batch["clip_low"], batch["clip_high"])
        return {**terms, "policy": (per_action * batch["token_weight"] * self._rescale(batch)).sum()}


class DifficultyFilter(VarianceFilter):
    """The variance filter, and groups whose success rate is at most `max_success` leave the batch too."""

    name = "difficulty-filter"
    max_success: float = 1 / 8

    def kept_groups(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        success = group_means(batch["rewards"].float(), batch["group"])
        return super().kept_groups(batch) & (success > self.max_success + 1e-9)
