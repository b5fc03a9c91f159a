"""The tool-call world the tool tasks share: tokens in, tokens out.

A query digit x (6 values); the policy writes a call argument (right: x); the tool writes its reply into the
sequence, a status flag and 3 reply slots; the policy reads them as tokens and writes a 3-digit answer, paid the
share of its digits equal to res[x], the 3 digits of a fixed table. With some probability an episode is in the
rare tool state (flag RARE); what the tool writes then is the task's (`ToolWorld.reply`): a shifted format in
rare-tool-states, a timeout in tool-recovery. Tokens the policy writes after a rare reply are the tool-state
tokens (`tool_mask` in the trainer's batch).

Here: the slot layout, the table, the policy's inputs and its MLP, the batched world the tool-PPO trainer drives
(`ToolWorld`), the gymnasium environment over it (`ToolEnv`), the supervised warm-up (`warm_up`) and the exact
expected share of right digits by enumeration (`ExactReturns`). The tasks hold their injection, schedule,
ground truth and registration.
"""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch
from stabench.baselines.models import sequential
from stabench.tasks.worlds.tokens import on_default_device
from torch import nn

N_DIGITS = 6  # the policy emits digits 0..5; queries are digits too
N_QUERIES = N_DIGITS
OK, RARE, PAD = N_DIGITS, N_DIGITS + 1, N_DIGITS + 2  # reply flags (the usual state, the rare one) and padding
N_SYMBOLS = N_DIGITS + 3
# Slots: 0 query x | 1 call argument a (policy) | 2 reply flag | 3-5 reply | 6-8 answer (policy).
N_SLOTS = 9
CALL_SLOT, FLAG_SLOT, REPLY_SLOTS, ANSWER_SLOTS = 1, 2, (3, 4, 5), (6, 7, 8)
POLICY_SLOTS = (CALL_SLOT, *ANSWER_SLOTS)
TURN_OF_SLOT = (0, 1, 1, 1)  # turn 0: the call; turn 1: the answer
TABLE_SEED = 0
N_INPUTS = N_SLOTS * N_SYMBOLS + len(POLICY_SLOTS)
_SLOTS = torch.arange(N_SLOTS)
HIDDEN = 64
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 300, 128, 1e-2


def result_table() -> torch.Tensor:
    """res[x]: the 3 digits the tool returns for argument x (fixed), LongTensor [N_QUERIES, 3]."""
    rng = np.random.default_rng(TABLE_SEED)
    return on_default_device(rng.integers(0, N_DIGITS, (N_QUERIES, 3)))


RESULTS = result_table()


def right_share(queries: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Share of the 3 answer digits equal to res[query]."""
    return (answers == RESULTS[queries]).float().mean(1)


def inputs(ctx: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """[B, P, N_SLOTS * N_SYMBOLS + P]: for policy slot k, the one-hot context before it and a one-hot of k.

    With `k` given, only that slot's rows: [B, N_SLOTS * N_SYMBOLS + P].
    """
    if k is not None:
        seen = torch.where(_SLOTS < POLICY_SLOTS[k], ctx, PAD)
        x = torch.zeros(len(ctx), N_INPUTS)
        x[:, : N_SLOTS * N_SYMBOLS] = nn.functional.one_hot(seen, N_SYMBOLS).flatten(1)
        x[:, N_SLOTS * N_SYMBOLS + k] = 1.0
        return x
    return torch.stack([inputs(ctx, k) for k in range(len(POLICY_SLOTS))], 1)


def context_policy(hidden: int = HIDDEN) -> nn.Module:
    """A 2-hidden-layer tanh MLP from the visible context (one-hot slots) to logits over the digits."""
    return nn.Sequential(
        nn.Linear(N_INPUTS, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, N_DIGITS)
    )


class ToolWorld:
    """The batched environment the trainer drives (the protocol is in baselines/tool_ppo.py).

    An episode is in the rare tool state with probability `rare_prob` (`info["rare"]`); a subclass says what the
    tool writes in its 3 reply slots (`reply`) and may change what an answer earns (`reward`).
    """

    n_slots, n_actions, n_queries = N_SLOTS, N_DIGITS, N_QUERIES
    policy_slots, turn_of_slot = POLICY_SLOTS, TURN_OF_SLOT
    inputs = staticmethod(inputs)

    @staticmethod
    def reply(digits: torch.Tensor, rare: torch.Tensor) -> torch.Tensor:
        """The reply slots [B, 3] for the tool's result `digits` [B, 3], by episode state `rare` [B]."""
        raise NotImplementedError

    def reset(self, queries: torch.Tensor, rng: np.random.Generator, rare_prob: float) -> tuple[torch.Tensor, dict]:
        ctx = torch.full((len(queries), N_SLOTS), PAD, dtype=torch.long)
        ctx[:, 0] = queries
        rare = on_default_device(rng.random(len(queries)) < rare_prob)
        return ctx, {"queries": queries, "rare": rare}

    def write(self, ctx: torch.Tensor, slot: int, info: dict) -> None:
        if slot == FLAG_SLOT:
            ctx[:, slot] = torch.where(info["rare"], RARE, OK)
        elif slot in REPLY_SLOTS:
            ctx[:, slot] = self.reply(RESULTS[ctx[:, CALL_SLOT]], info["rare"])[:, REPLY_SLOTS.index(slot)]

    def tool_state(self, ctx: torch.Tensor, slot: int) -> torch.Tensor:
        return (ctx[:, FLAG_SLOT] == RARE) & (slot in ANSWER_SLOTS)

    def reward(self, ctx: torch.Tensor, info: dict) -> torch.Tensor:
        return right_share(ctx[:, 0], ctx[:, list(ANSWER_SLOTS)])


class ToolEnv(gym.Env):
    """One episode of a `ToolWorld` as a gymnasium environment.

    Observation: the 9 slots of the episode so far (PAD where nothing is written yet). Action: the next digit the
    policy writes. Step 1 writes the call argument; the tool then writes its flag and 3 reply slots (in the rare
    state with probability `rare_prob`); steps 2-4 write the answer, and the last step pays the world's reward.
    """

    metadata = {"render_modes": []}

    def __init__(self, world: ToolWorld, rare_prob: float) -> None:
        self.rare_prob = rare_prob
        self.observation_space = gym.spaces.MultiDiscrete(np.full(N_SLOTS, N_SYMBOLS, dtype=np.int64))
        self.action_space = gym.spaces.Discrete(N_DIGITS)
        self._world, self._ctx, self._info, self._k = world, torch.empty(0), {}, 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        query = torch.tensor([int(self.np_random.integers(N_QUERIES))])
        self._ctx, self._info = self._world.reset(query, self.np_random, self.rare_prob)
        self._k = 0
        return self._ctx[0].cpu().numpy().copy(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not a digit in 0..{N_DIGITS - 1}")
        if self._k >= len(POLICY_SLOTS):
            raise RuntimeError("the episode is over; call reset()")
        slot = POLICY_SLOTS[self._k]
        self._ctx[0, slot] = int(action)
        self._k += 1
        next_slot = POLICY_SLOTS[self._k] if self._k < len(POLICY_SLOTS) else N_SLOTS
        for s in range(slot + 1, next_slot):
            self._world.write(self._ctx, s, self._info)
        done = self._k == len(POLICY_SLOTS)
        reward = float(self._world.reward(self._ctx, self._info)[0]) if done else 0.0
        info = {"tool_state": bool(self._ctx[0, FLAG_SLOT] == RARE)}
        return self._ctx[0].cpu().numpy().copy(), reward, done, False, info


AnswerTargets = Callable[[torch.Tensor, torch.Tensor, np.random.Generator], torch.Tensor]


def warm_up(world: ToolWorld, rare_share: float, targets: AnswerTargets) -> nn.Module:
    """The policy after a short supervised warm-up (deterministic, one thread).

    Examples: the right call, the tool's reply (rare with probability `rare_share`), and the answer
    `targets(queries, rare, rng)` [B, 3] (the task's: what the warm start knows of the rare state).
    """
    with torch.random.fork_rng():
        torch.manual_seed(TABLE_SEED)
        model = context_policy()
        rng = np.random.default_rng(TABLE_SEED)
        optimizer = torch.optim.Adam(model.parameters(), lr=WARMUP_LR)
        for _ in range(WARMUP_STEPS):
            queries = on_default_device(rng.integers(0, N_QUERIES, WARMUP_BATCH))
            ctx, info = world.reset(queries, rng, rare_share)
            ctx[:, CALL_SLOT] = queries
            for s in (FLAG_SLOT, *REPLY_SLOTS):
                world.write(ctx, s, info)
            ctx[:, list(ANSWER_SLOTS)] = targets(queries, info["rare"], rng)
            logits = model(inputs(ctx))
            labels = ctx[:, list(POLICY_SLOTS)]
            loss = nn.functional.cross_entropy(logits.reshape(-1, N_DIGITS), labels.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model


class ExactReturns:
    """(expected share of right digits in the usual state, in the rare state) of a policy at temperature 1,
    exactly, for the replies of `world`.

    Sums over the call argument and over every answer prefix: E[share of right digits] =
    mean over queries of sum_a pi(a | x) mean_i P(y_i = res[x]_i | x, a, reply).
    """

    def __init__(self, world: ToolWorld) -> None:
        q, a, rare = torch.meshgrid(torch.arange(N_QUERIES), torch.arange(N_DIGITS), torch.arange(2), indexing="ij")
        q, a, rare = q.reshape(-1), a.reshape(-1), rare.reshape(-1).bool()
        ctx = torch.full((len(q), N_SLOTS), PAD, dtype=torch.long)
        ctx[:, 0], ctx[:, CALL_SLOT] = q, a
        ctx[:, FLAG_SLOT] = torch.where(rare, RARE, OK)
        ctx[:, list(REPLY_SLOTS)] = world.reply(RESULTS[a], rare)
        n, d = len(ctx), N_DIGITS
        ctx2 = ctx.repeat_interleave(d, 0)
        ctx2[:, ANSWER_SLOTS[0]] = torch.arange(d).repeat(n)
        ctx3 = ctx.repeat_interleave(d * d, 0)
        ctx3[:, ANSWER_SLOTS[0]] = torch.arange(d).repeat_interleave(d).repeat(n)
        ctx3[:, ANSWER_SLOTS[1]] = torch.arange(d).repeat(d * n)
        self.query, self.call, self.rare = q, a, rare
        self.inputs = torch.cat([inputs(ctx, 0), inputs(ctx, 1), inputs(ctx2, 2), inputs(ctx3, 3)])

    @torch.no_grad()
    def __call__(self, policy: nn.Module) -> tuple[float, float]:
        n, d = len(self.query), N_DIGITS
        probs = torch.softmax(sequential(policy, self.inputs).double(), -1)
        p_call = probs[:n].gather(-1, self.call[:, None]).squeeze(-1)  # pi(a | x)
        p1 = probs[n : 2 * n]  # [n, y1]
        p2 = probs[2 * n : 2 * n + n * d].view(n, d, d)  # [n, y1, y2]
        p3 = probs[2 * n + n * d :].view(n, d, d, d)  # [n, y1, y2, y3]
        target = RESULTS[self.query]  # [n, 3]
        right1 = p1.gather(-1, target[:, :1]).squeeze(-1)
        joint12 = p1[:, :, None] * p2  # P(y1, y2)
        right2 = (p1 * p2.gather(-1, target[:, 1, None, None].expand(n, d, 1)).squeeze(-1)).sum(-1)
        right3 = (joint12 * p3.gather(-1, target[:, 2, None, None, None].expand(n, d, d, 1)).squeeze(-1)).sum((1, 2))
        per_context = p_call * (right1 + right2 + right3) / 3
        usual = float(per_context[~self.rare].sum() / N_QUERIES)
        rare = float(per_context[self.rare].sum() / N_QUERIES)
        return usual, rare
