"""Stabilizers that treat the tokens a policy writes in tool states apart from its text tokens.

A multi-turn trainer marks each token the policy wrote after a tool's reply put the episode in a tool state
(`tool_mask`, [B, P], a key a task `provides`). With outcome rewards and group-normalized advantages
(`tool-ppo`), an episode that hit a tool state and one that did not are compared against one group
baseline, so the gap between the two kinds of episode (a timeout paid less, whatever the policy did)
becomes a large advantage of one sign on every token written after the tool's reply, and the part of the
advantage that says which recovery was right is compressed by the same gap.

- `tool-state-groups` (state-grouped advantages, after GiGPO's step-level groups, Feng et al. 2025, which
  compare actions only among rollouts that reached the same environment state): within each prompt group,
  the episodes that reached a tool state and those that did not form two subgroups, and each episode's
  advantage is its reward normalized within its own subgroup, (R_i - mean_sub R) / (std_sub R + eps),
  broadcast to its tokens. A subgroup of one episode gets advantage 0. Where every episode of a group is of
  one kind it is the trainer's group advantage.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from stabench.suite.api import Stabilizer


def subgroup_advantages(
    rewards: torch.Tensor, group: torch.Tensor, kind: torch.Tensor, eps: float = 1e-4
) -> torch.Tensor:
    """[B] reward normalized within (group, kind) subgroups: (R - mean) / (population std + eps); 0 alone."""
    key = group.long() * 2 + kind.long()
    n = int(key.max()) + 1 if len(key) else 0
    count = torch.zeros(n, dtype=rewards.dtype).index_add_(0, key, torch.ones_like(rewards))
    mean = torch.zeros(n, dtype=rewards.dtype).index_add_(0, key, rewards) / count.clamp_min(1)
    centred = rewards - mean[key]
    var = torch.zeros(n, dtype=rewards.dtype).index_add_(0, key, centred**2) / count.clamp_min(1)
    adv = centred / (var.sqrt()[key] + eps)
    return torch.where(count[key] > 1, adv, torch.zeros_like(adv))


class ToolStateGroups(Stabilizer):
    name = "tool-state-groups"
    needs = frozenset({"advantages", "rewards", "group", "tool_mask", "mask"})
    eps: float = 1e-4

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        kind = (batch["tool_mask"].bool() & batch["mask"].bool()).any(1)
        adv = subgroup_advantages(batch["rewards"].float(), batch["group"], kind, self.eps)
        return adv[:, None].expand_as(advantages) * batch["mask"]
