"""Stabilizers that add or repair a value estimate: mini-critics for critic-free GRPO, critic warm-up after a
value head is replaced, and CHAIN's value-churn regularizer for DQN.

## mini-critics

Mini-critics for critic-free GRPO (AsyPPO-style, Liu et al. 2025; /work/shared/METHODS.md section 7).

M lightweight critics V_1..V_M (M = 2), each an MLP
(one tanh layer, 32 wide) over the one-hot state: the prompt and the answer prefix (later slots padded) and
the position. Value of the state before answer token t (prompt ++ a_<t): V(s_t) = mean_m V_m(s_t); the
terminal value is the answer's reward, V(s_L) = R, after the answer's last real token (answers of different
lengths: after each one's own EOS). Per-token advantages by GAE with gamma = 1:
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

## critic-warmup

Critic warm-up after a value head is replaced (value pretraining, Yuan et al. 2025, VC-PPO).

Critic warm-up. For the first `iterations` iterations after the trainer replaced its critic
(`batch["critic_resets"] > 0` and `batch["critic_age"] < iterations`) only the critic trains: the loss is

    L = sum_t w_t (V(s_t) - G^MC_t)^2 / 2,

with G^MC the Monte-Carlo return-to-go (`batch["mc_returns"]`, lambda = 1 targets, as VC-PPO pretrains its
value model) and w the trainer's token weights; the policy and entropy terms are dropped, so the policy's
parameters get no gradient and its Adam does not step (a parameter without a gradient is skipped). Why
Monte-Carlo targets: the trainer's own lambda-return targets G_t = A_t + V(s_t) bootstrap from the critic
being repaired ((1 - lambda) V(s_{t+1}) per step), so a badly scaled head chases its own errors; regressing
on the sampled return removes them at the rate of a supervised fit. After the warm-up the trainer's terms
pass unchanged. The critic the trainer was built with is not warmed up (`critic_resets` is 0 for it).

## chain

CHAIN value-churn reduction (Tang & Berseth 2024, "Improving Deep RL by Reducing the Chain Effect of
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

Measured on `policy-churn` (see that task): in the healthy regime CHAIN lowers per-update policy churn and
raises the return a little (paper/tables/fidelity.md, P12, measures the churn on the method matrix's injected
runs); it does not prevent the collapse a learning-rate shock causes there, which runs through saturated units
rather than churn.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from stabench.baselines import adam
from stabench.suite.api import Stabilizer
from torch import nn


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


def gae(values: torch.Tensor, rewards: torch.Tensor, lam: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token advantages [B, L] from values V(s_0..s_{L-1}) [B, L] and terminal rewards R [B] (gamma = 1).

    `mask` [B, L] (1.0 on each answer's real tokens, a prefix): R is the value after each answer's LAST REAL token,
    and padding adds nothing (0 there). None: every answer fills all L tokens."""
    nxt = torch.cat([values[:, 1:], rewards[:, None]], dim=1)  # V(s_{t+1}), with V(s_L) = R
    if mask is not None:  # ragged answers: V(s_{n_i}) = R_i after answer i's n_i real tokens
        last = (mask.sum(1).long() - 1).clamp_min(0)
        nxt = nxt.scatter(1, last[:, None], rewards[:, None].to(nxt.dtype)) * mask
        values = values * mask
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
    needs = frozenset({"prompts", "answers", "group", "rewards", "mask"})
    n_critics: int = 2
    lam: float = 0.8  # 0.5 until missing-critic v3 (chosen on seeds 0-9: see the task docstring)
    critic_lr: float = 1e-2
    critic_steps: int = 4
    center: bool = True
    critic_seed: int = 12345

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        config, length = spec["model_config"], int(spec["answer_len"])
        positions = config.get("n_positions") or config["max_position_embeddings"]  # GPT-2's name, or Mixtral's
        vocab, prompt_len = config["vocab_size"], positions - length  # the task sizes the policy for prompt ++ answer
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.critic_seed + int(spec.get("seed", 0)))
            self.critics = nn.ModuleList(TinyCritic(vocab, prompt_len, length) for _ in range(self.n_critics))
        self.critic_opt = torch.optim.Adam(self.critics.parameters(), lr=self.critic_lr, foreach=True)
        return model

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        prompts, answers, mask = batch["prompts"], batch["answers"], batch["mask"]
        rewards = batch["rewards"].float()
        with torch.no_grad():
            per_critic = torch.stack([c(prompts, answers) for c in self.critics])  # [M, B, L]
        adv = gae(per_critic.mean(0), rewards, self.lam, mask) * mask
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
            adam.zero_grad(self.critic_opt)
            loss.backward()
            adam.step(self.critic_opt)


def warmup_value_loss(new_values: torch.Tensor, returns: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
    """sum_t w_t (V_t - G^MC_t)^2 / 2: the critic-only loss of the warm-up."""
    return (0.5 * (new_values - returns).pow(2) * token_weight).sum()


class CriticWarmup(Stabilizer):
    """Train only the critic, on Monte-Carlo returns, for `iterations` iterations after a critic reset."""

    name = "critic-warmup"
    needs = frozenset({"critic_resets", "critic_age", "new_values", "mc_returns", "token_weight"})
    iterations: int = 20

    def warming(self, batch: Mapping[str, torch.Tensor]) -> bool:
        return int(batch["critic_resets"]) > 0 and int(batch["critic_age"]) < self.iterations

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.warming(batch):
            return terms
        return {"value": warmup_value_loss(batch["new_values"], batch["mc_returns"], batch["token_weight"])}


def chain_regularizer(q: torch.Tensor, q_prev: torch.Tensor) -> torch.Tensor:
    """MSE over states and actions between Q_theta and the (detached) Q_prev on the reference batch."""
    return (q - q_prev.detach()).pow(2).mean()


class Chain(Stabilizer):
    name = "chain"
    needs = frozenset({"ref_obs"})
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
            torch._foreach_copy_(list(self.prev.parameters()), list(self.net.parameters()))  # theta_t, one back next
        reg = chain_regularizer(self.net(ref), q_prev)
        lam = self.lam
        if self.auto:
            self.main_sum += float(terms["td"].detach().abs())
            self.reg_sum += float(reg.detach())
            lam = self.beta * self.main_sum / self.reg_sum if self.reg_sum > 0 else 0.0
        return {**terms, "chain": lam * reg}
