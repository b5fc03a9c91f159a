"""Against reward hacking of a learned proxy: a conservative reward-model ensemble and a KL anchor.

Setting (tasks/reward_hacking.py): the policy is trained on a learned reward, an ensemble of M reward models
whose per-answer predictions reach the trainer's batch as `reward_ensemble` [B, M]. Where the models were
fitted (the policy's recent answers) they agree; off that support their extrapolations differ, and a policy
that maximizes the ensemble mean is drawn to exactly the answers where the mean over-estimates.

- Conservative ensemble (uncertainty-weighted optimization, Coste et al. 2023): the reward of answer i is
      R_i = mean_m r_im - k * std_m r_im      (std over the M members, unbiased, M - 1 in the denominator)
  and the advantage is recomputed from it as GRPO does, A_i = (R_i - mean_group R) / (std_group R + 1e-4)
  (1e-4 is GRPOConfig's default adv_eps), broadcast over the answer's tokens. Plus the KL anchor below.
- KL anchor: the per-token regularizer in the loss becomes (anchor_beta / beta) * k2, k2 = d^2 / 2 with
  d = log ref - log pi, so the loss carries anchor_beta * k2 whatever the trainer's own beta. k2's expected
  gradient is the gradient of the per-token reverse KL(pi || ref); the trainer's default k3 follows the
  forward KL and barely resists mass moving onto tokens the reference finds rare (see kl_estimators.py),
  which is where a hacking policy goes here. The anchor alone is the plain guard the fix is ablated against.
- Conservative ensemble without the anchor (`ConservativeEnsembleNoAnchor`, not registered; run it by plugin
  reference `baselines.stabilizers.reward_ensemble:ConservativeEnsembleNoAnchor`): the same advantages, the
  trainer's own KL term untouched. The ablation that says which part of the fix does the work.

Both read beta from `batch["kl_coef"]`. Without `reward_ensemble` in the batch (another task), the
conservative ensemble leaves the advantages as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from suite.api import Stabilizer

ADV_EPS = 1e-4  # GRPOConfig.adv_eps


def conservative_reward(ensemble: torch.Tensor, k: float) -> torch.Tensor:
    """mean - k * std over the members (last axis) of per-answer predictions [B, M]: [B]."""
    return ensemble.mean(-1) - k * ensemble.std(-1)


def group_normalized(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """(R - mean_group R) / (std_group R + ADV_EPS), groups given by an index per answer (unbiased std)."""
    n = int(group.max()) + 1
    count = torch.zeros(n, dtype=rewards.dtype).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(n, dtype=rewards.dtype).index_add_(0, group, rewards) / count
    centred = rewards - mean[group]
    var = torch.zeros(n, dtype=rewards.dtype).index_add_(0, group, centred**2) / (count - 1).clamp_min(1)
    return centred / (var.sqrt()[group] + ADV_EPS)


def k2_anchor(batch: Mapping[str, torch.Tensor], anchor_beta: float) -> torch.Tensor:
    """(anchor_beta / beta) * k2 per token: the loss then carries anchor_beta * k2."""
    k2 = 0.5 * (batch["ref_logp"] - batch["logp"]).pow(2)
    return (anchor_beta / batch["kl_coef"]) * k2


class KLAnchor(Stabilizer):
    """The plain guard: a stronger reverse-KL anchor to the reference (anchor_beta * k2 in the loss)."""

    name = "kl-k2-anchor"
    trainers = frozenset({"grpo"})
    anchor_beta: ClassVar[float] = 0.05

    def kl_loss(self, per_token_kl: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return k2_anchor(batch, self.anchor_beta)


class ConservativeEnsemble(KLAnchor):
    """Advantages from mean - k * std of the reward-model ensemble, plus the KL anchor."""

    name = "conservative-ensemble"
    k: ClassVar[float] = 4.0

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ensemble = batch.get("reward_ensemble")
        if ensemble is None:
            return advantages
        reward = conservative_reward(ensemble.double(), self.k)
        return (group_normalized(reward, batch["group"]).float()[:, None] * batch["mask"]).to(advantages.dtype)


class ConservativeEnsembleNoAnchor(Stabilizer):
    """The ablation: advantages from mean - k * std of the ensemble, the trainer's own KL term left as it is."""

    name = "conservative-ensemble-no-anchor"
    trainers = frozenset({"grpo"})
    k: ClassVar[float] = ConservativeEnsemble.k

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return ConservativeEnsemble.advantages(self, advantages, batch)  # type: ignore[arg-type]
