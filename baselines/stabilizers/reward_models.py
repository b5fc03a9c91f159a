"""Against reward hacking of a learned proxy: a conservative reward-model ensemble.

Setting (tasks/reward_hacking.py): the policy is trained on a learned reward, an ensemble of M reward models
whose per-answer predictions reach the trainer's batch as `reward_ensemble` [B, M] (the task provides the
key). Where the models were fitted (the policy's recent answers) they agree; off that support their
extrapolations differ, and a policy that maximizes the ensemble mean is drawn to exactly the answers where
the mean over-estimates.

- `conservative-ensemble` (uncertainty-weighted optimization, Coste et al. 2023): the reward of answer i is
      R_i = mean_m r_im - k * std_m r_im      (std over the M members, unbiased, M - 1 in the denominator)
  and the advantage is recomputed from it as GRPO does, A_i = (R_i - mean_group R) / (std_group R + 1e-4)
  (1e-4 is GRPOConfig's default adv_eps), broadcast over the answer's tokens. Plus the `kl-k2-anchor`
  (`kl.py`): 0.05 k2 in place of the trainer's KL term. k2's expected gradient is the per-token reverse
  KL(pi || ref); the trainer's default k3 follows the forward KL and barely resists mass moving onto tokens
  the reference finds rare, which is where a hacking policy goes here. The anchor alone is the plain guard
  the fix is ablated against.
- Without the anchor (`ConservativeEnsembleNoAnchor`, not registered; run it by plugin reference
  `stabench.baselines.stabilizers.reward_models:ConservativeEnsembleNoAnchor`): the same advantages, the
  trainer's own KL term untouched. The ablation that says which part of the fix does the work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from stabench.baselines.stabilizers.aggregation import group_normalized
from stabench.baselines.stabilizers.kl import KLk2Anchor
from stabench.suite.api import Stabilizer
from torch import nn


def conservative_reward(ensemble: torch.Tensor, k: float) -> torch.Tensor:
    """mean - k * std over the members (last axis) of per-answer predictions [B, M]: [B]."""
    return ensemble.mean(-1) - k * ensemble.std(-1)


def conservative_advantages(batch: Mapping[str, torch.Tensor], k: float, dtype: torch.dtype) -> torch.Tensor:
    """Group-normalized advantages of mean - k * std of the ensemble, broadcast over each answer's tokens."""
    reward = conservative_reward(batch["reward_ensemble"].double(), k)
    return (group_normalized(reward, batch["group"]).float()[:, None] * batch["mask"]).to(dtype)


class ConservativeEnsemble(KLk2Anchor):
    """Advantages from mean - k * std of the reward-model ensemble, plus the k2 anchor."""

    name = "conservative-ensemble"
    needs = KLk2Anchor.needs | {"reward_ensemble", "group", "mask"}
    k: ClassVar[float] = 4.0

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return conservative_advantages(batch, self.k, advantages.dtype)


class ConservativeEnsembleNoAnchor(Stabilizer):
    """The ablation: the conservative advantages, the trainer's own KL term left as it is (run by reference, kept
    out of the matrix: `listed = False`)."""

    name = "conservative-ensemble-no-anchor"
    listed = False
    needs = frozenset({"reward_ensemble", "group", "mask"})
    k: ClassVar[float] = ConservativeEnsemble.k

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return conservative_advantages(batch, self.k, advantages.dtype)


class R2MFeatures(Stabilizer):
    """R2M (Huang et al. 2026): the learned reward model reads the policy's evolving hidden states.

    Setting (tasks/reward_model_drift.py): the task's reward model is a linear head refitted every iteration on
    gold labels of the policy's samples, over a low-dimensional projection of a warm-start snapshot's hidden
    states. A task that lets the reward model's features be switched says so with `provides = {"rm_features"}`
    and reads the policy's `rm_features` attribute; this stabilizer sets it to "policy": the reward model reads
    its own features concatenated with the live policy's hidden states (detached), recomputed every iteration,
    as R2M feeds the policy's hidden states to the reward model. It changes no loss or gradient of the policy.
    """

    name = "r2m-features"
    needs = frozenset({"rm_features"})

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        model.rm_features = "policy"
        return model
