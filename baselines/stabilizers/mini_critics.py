"""Mini-critics for critic-free GRPO (AsyPPO-style, Liu et al. 2025; /work/shared/METHODS.md section 7).

`mini-critics` (the matched fix of missing-critic). M lightweight critics V_1..V_M (M = 2), each an MLP
(one tanh layer, 32 wide) over the one-hot state: the prompt and the answer prefix (later slots padded) and
the position. Value of the state before answer token t (prompt ++ a_<t): V(s_t) = mean_m V_m(s_t); the
terminal value is the answer's reward, V(s_L) = R. Per-token advantages by GAE with gamma = 1:
    delta_t = V(s_{t+1}) - V(s_t),    A_t = sum_{l >= 0} lambda^l delta_{t+l}      (lambda = 0.8)
(lambda = 1 gives A_t = R - V(s_t), lambda = 0 the one-step TD error), then minus their batch mean at each
position t (a per-position batch baseline on top, so that a biased critic, e.g. a fresh one, cannot push every
sampled token the same way). The advantages use the critics as they were before this iteration's data; then
each critic takes `critic_steps` Adam steps on the MSE (V_m(s_t) - R)^2 over every prefix of ITS share of each
group's answers (answer i of a group goes to critic i mod M): the critics see disjoint data. The masking of
tokens where the critics agree (AsyPPO's further step) is not used: its details are unverified. The critics
have their own optimizer and live inside the stabilizer, which lives inside the trainer: `copy.deepcopy`
branches them. What they buy over a sequence-level baseline: a token whose state's value does not depend on
it (the unscored sub-steps of a short problem, the steps after a mistake) gets an advantage near 0 instead
of its answer's whole R - b.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from baselines.stabilizers.clip_higher import GRPOEntropyBonus
from suite.api import Stabilizer


class TinyCritic(nn.Module):
    """A small MLP over the one-hot state (prompt ++ answer prefix, later slots padded) and the position."""

    def __init__(self, vocab_size: int, prompt_len: int, answer_len: int, width: int = 32) -> None:
        super().__init__()
        self.vocab, self.length = vocab_size, answer_len
        self.net = nn.Sequential(nn.Linear(vocab_size * (prompt_len + answer_len) + answer_len, width), nn.Tanh(),
                                 nn.Linear(width, 1))

    def forward(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        """V(s_t) for t = 0 .. L-1, [B, L]: the state before answer token t (answer slots >= t padded)."""
        b, length = answers.shape
        pad = self.vocab - 1  # the special BOS/EOS/padding id
        seen = torch.arange(length)[None, :] < torch.arange(length)[:, None]  # [t, slot]: slot written before t
        prefix = torch.where(seen[None], answers[:, None, :], pad)  # [B, L(t), L(slot)]
        tokens = torch.cat([prompts[:, None, :].expand(b, length, -1), prefix], dim=2)
        onehot = nn.functional.one_hot(tokens, self.vocab).float().flatten(2)
        position = torch.eye(length)[None].expand(b, -1, -1)
        return self.net(torch.cat([onehot, position], dim=2)).squeeze(-1)


def gae(values: torch.Tensor, rewards: torch.Tensor, lam: float) -> torch.Tensor:
    """Per-token advantages [B, L] from values V(s_0..s_{L-1}) [B, L] and terminal rewards R [B] (gamma = 1)."""
    nxt = torch.cat([values[:, 1:], rewards[:, None]], dim=1)  # V(s_{t+1}), with V(s_L) = R
    delta = nxt - values
    adv = torch.zeros_like(values)
    running = torch.zeros_like(rewards)
    for t in range(values.shape[1] - 1, -1, -1):
        running = delta[:, t] + lam * running
        adv[:, t] = running
    return adv


class MiniCritics(Stabilizer):
    """M tiny critics on disjoint halves of each group; their mean value gives per-token GAE advantages."""

    name = "mini-critics"
    trainers = frozenset({"grpo"})
    n_critics: int = 2
    lam: float = 0.8  # 0.5 until missing-critic v3 (chosen on seeds 0-9: see the task docstring)
    critic_lr: float = 1e-2
    critic_steps: int = 4
    center: bool = True
    critic_seed: int = 12345

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        vocab, length = spec["model_config"]["vocab_size"], int(spec["answer_len"])
        prompt_len = spec["model_config"]["n_positions"] - length  # the task sizes the policy for prompt ++ answer
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.critic_seed + int(spec.get("seed", 0)))
            self.critics = nn.ModuleList(TinyCritic(vocab, prompt_len, length) for _ in range(self.n_critics))
        self.critic_opt = torch.optim.Adam(self.critics.parameters(), lr=self.critic_lr)
        return model

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        prompts, answers, mask = batch["prompts"], batch["answers"], batch["mask"]
        rewards = batch["rewards"].float()
        with torch.no_grad():
            per_critic = torch.stack([c(prompts, answers) for c in self.critics])  # [M, B, L]
        adv = gae(per_critic.mean(0), rewards, self.lam) * mask
        if self.center:  # a per-position batch baseline on top: the critics' bias cannot push every token one way
            adv = (adv - (adv.sum(0) / mask.sum(0).clamp_min(1))[None]) * mask
        self._fit(prompts, answers, mask, rewards, batch["group"])
        return adv

    def _fit(self, prompts: torch.Tensor, answers: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor,
             group: torch.Tensor) -> None:
        """`critic_steps` Adam steps on each critic's MSE to the return, over its own share of every group."""
        member = torch.arange(len(group)) - torch.searchsorted(group, group)  # index of the answer in its group
        target = rewards[:, None].expand_as(mask)
        for _ in range(self.critic_steps):
            loss = prompts.new_zeros((), dtype=torch.float32)
            for m, critic in enumerate(self.critics):
                rows = member % self.n_critics == m
                err = (critic(prompts[rows], answers[rows]) - target[rows]).pow(2) * mask[rows]
                loss = loss + err.sum() / mask[rows].sum().clamp_min(1)
            self.critic_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.critic_opt.step()


class LowEntropyBonus(GRPOEntropyBonus):
    """The built-in `grpo-entropy-bonus` guard at coef 0.01 (named non-fix of missing-critic).

    At its own coef 0.3 the guard holds the walk-chain policy at the uniform entropy ln 4 and fails the control
    too (exact LONG success 0.00 on seeds 0-4); at 0.01 the control stays healthy (0.80), so what it does to the
    injected branch measures entropy alone.
    """

    name = "grpo-entropy-bonus-low"
    coef: float = 0.01
