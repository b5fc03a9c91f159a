"""tool-recovery: tool timeouts become common, and group advantages put an uninformative push on the
low-confidence tokens written after them (see results/calibration.md).

The world (a gymnasium env, `stabench/ToolRecovery-v0`, tokens in, tokens out). A query digit x (6 values);
the policy writes a call argument (right: x); the tool writes its reply into the sequence: a status flag
and 3 reply slots. A usual reply (flag OK) carries the 3 digits res[x] of a fixed table, and the policy
copies them into its 3-digit answer. A timeout (flag ERR) carries no result (the 3 slots read ERR), and
the right recovery is to answer res[x] from the query alone, which the policy has seldom practised. Paid:
the share of answer digits equal to res[x]. Tokens the policy writes after a timeout are the tool-state
tokens (`tool_mask` in the batch, `turn` 1 with the answer).

Policy and trainer. A 2 x 64 tanh MLP over the one-hot context (the slots written so far) emits the digits; it
starts from a supervised warm-up that copies usual replies and has seen few timeouts, whose answer targets
were mostly random digits (each the right digit with probability `WARMUP_RECOVERY`, 0.2): after a timeout it
leans a little towards the recovery and is far from it. `baselines/tool_ppo.py` with its sampler equal to the
policy (no sampling mismatch): 12 queries x 8 episodes per iteration, group-normalized outcome advantages, 4
epochs over each rollout (reuse), Adam 1.5e-3, clip 0.2, no KL or entropy term.

What must be learned after onset. At onset (iteration 20 of 160 at quick) timeouts go from 2% of the
replies to 60% in BOTH branches: the new problem is the recovery, which the policy at onset does badly (it
is close to uniform after a timeout); the optimum is 1. The injection (injected branch only, from onset): the
environment pays an answer after a timeout only `timeout_pay` (0.1) of its share of right digits, a
latency penalty, so a timed-out episode earns at most 0.1 while a usual one earns about 1. The
ground truth measures the answers, not the pay: the exact expected share of right digits.

Ground truth: the exact expected share of right digits of the trained policy (temperature 1), by
enumeration over the call and every answer prefix, under the branch's current timeout share; failure = its
mean over the last 25% of the run below 0.8. With 60% timeouts a policy that never learns the recovery
scores at most 0.4 + 0.6 x its recovery score.

Normalized return: `return_floor` the exact post-onset return of the policy frozen at onset (the
`frozen-at-onset` reference), `return_ceiling` the baseline control's post-onset mean return (the optimum 1 is
not reached at once); both averaged over calibration seeds 0-9 at the quick budget, measured once and fixed.
Seeds each setting was chosen on: the world, the trainer, the shares (0.02 / 0.6), the pay 0.1 and
`tool-state-groups` as the matched fix on seeds 0-2 (a prototype outside the suite); the learning rate (1.5e-3
instead of 3e-3) and the budget (160 iterations instead of 120) on design seeds 10-19 and the prototype's
seeds 10, 13, 15, 18, 19, because at 3e-3 several controls committed early to a partly wrong recovery and
stalled (a plain-PPO stall, in both branches, that no budget cures); the warm-up's `WARMUP_RECOVERY` (0.2
instead of 0, version 2) on design seeds 20-59, because at version 1 plain PPO still stalled on a partly wrong
recovery in some controls (on design seeds and on fresh seeds 100-109): a policy near-uniform after a timeout
can commit early to a wrong digit of some query, and a slight lean towards the right digits at onset removes
those stalls in the control while the injected branch still fails and the fix still works (all three checked
on design seeds 20-59); the floor and the ceiling on seeds 0-9. Seeds 100-109 were re-run at version 2
although they had been used once at version 1: that re-check was prompted by their own miss (the control's
stalls), as rare-tool-states version 4's was, so seeds 200-209, never used before version 2 was frozen, were
run as well. The measured numbers are in results/calibration.md.

Mechanism (as measured at version 1 on design seeds 10-19; the calibration rows of version 2 show the same).
In a group of 8 episodes of one query, the timed-out ones (60%) earn at most 0.1, the usual ones about 1: the
group std is set by that gap, so every token written after a timeout gets an advantage of about -0.8 whatever
it is, and the difference between a right and a wrong recovery (at most 0.1 in reward) is compressed to a
small share of it. The tool-state tokens are close to uniform (low confidence), so theirs are the large
softmax gradients (a confident token's is near zero) in both branches; in the injected branch these updates
carry almost no signal. The mean |advantage| on tool-state tokens is the same in both branches while the
control learns (what changes is what it says, not its size), and the injected branch's ratio tails and clip
fraction are, if anything, smaller than the control's: not a ratio blow-up. The tool-state entropy stays high
and falls only slowly, the recovery is not learned, and the text tokens, confident and rewarded, stay right.
The aggregate return leaves the control's a few iterations after onset, when the tool-state entropy does (the
split diagnostic moves with the aggregate return here, not before it); what the learner sees, its mean reward,
drops at onset, with the pay. Comparing each episode only with the episodes of its group that reached the same
kind of state restores the signal: `tool-state-groups` (advantages normalized within the tool-state and
text-state subgroups of each group) learns the recovery as the control does. Named non-fixes, run beside it:
`grad-clip` (Adam normalizes the length away), `entropy-bonus`, `advantage-clip` (it bounds the push, it does
not restore the compressed signal).

Diagnostics split by tool and text states: `entropy_tool` / `entropy_text` (mean token entropy of the policy
after the iteration's update, on the batch's tokens),
`adv_abs_tool` / `adv_abs_text` (mean |advantage| per token), `return_tool` / `return_text`, and from
`ratio_tails` `ratio_p99_tool` / `ratio_ess_tool` beside `ratio_p99_text` / `ratio_ess_text`; their
aggregates are `entropy`, `adv_abs`, `return`, `ratio_p99`, `ratio_ess`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pandas as pd
import torch
from stabench.baselines.tool_ppo import ToolPPO, ToolPPOConfig
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS, categorical_entropy
from stabench.suite.figures import fix_against_baseline
from stabench.tasks.worlds.tokens import WarmStart, on_default_device
from torch import nn

# --- The world. --------------------------------------------------------------------------------------------
N_DIGITS = 6  # the policy emits digits 0..5; queries are digits too
N_QUERIES = N_DIGITS
OK, ERR, PAD = N_DIGITS, N_DIGITS + 1, N_DIGITS + 2  # reply status flags (ERR also marks an empty reply slot)
N_SYMBOLS = N_DIGITS + 3
# Slots: 0 query x | 1 call argument a (policy) | 2 status flag | 3-5 reply | 6-8 answer (policy).
N_SLOTS = 9
CALL_SLOT, FLAG_SLOT, REPLY_SLOTS, ANSWER_SLOTS = 1, 2, (3, 4, 5), (6, 7, 8)
POLICY_SLOTS = (CALL_SLOT, *ANSWER_SLOTS)
TURN_OF_SLOT = (0, 1, 1, 1)  # turn 0: the call; turn 1: the answer
TABLE_SEED = 0
N_INPUTS = N_SLOTS * N_SYMBOLS + len(POLICY_SLOTS)
_SLOTS = torch.arange(N_SLOTS)
TIMEOUT_BEFORE = 0.02  # probability of a timeout before onset
TIMEOUT_AFTER = 0.6  # ... after onset, both branches
TIMEOUT_PAY = 0.1  # the injected branch's pay for an answer after a timeout, per unit of right digits

# --- The policy, its warm start, the trainer. -------------------------------------------------------------
HIDDEN = 64
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR, WARMUP_TIMEOUT = 300, 128, 1e-2, 0.1
WARMUP_RECOVERY = 0.2  # share of the warm-up's answer digits after a timeout that are right (the rest random)
CONFIG = ToolPPOConfig(n_groups=12, group_size=8, lr=1.5e-3, epochs=4, minibatches=1)


def result_table() -> torch.Tensor:
    """res[x]: the 3 digits the tool returns for argument x (fixed per task version), LongTensor [N_QUERIES, 3]."""
    rng = np.random.default_rng(TABLE_SEED)
    return on_default_device(rng.integers(0, N_DIGITS, (N_QUERIES, 3)))


RESULTS = result_table()


def right_share(queries: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Share of the 3 answer digits equal to res[query]."""
    return (answers == RESULTS[queries]).float().mean(1)


class RecoveryWorld:
    """The batched environment the trainer drives (see baselines/tool_ppo.py for the protocol).

    `timeout_pay` scales the pay of an episode that timed out (1.0: paid as any other).
    """

    n_slots, n_actions, n_queries = N_SLOTS, N_DIGITS, N_QUERIES
    policy_slots, turn_of_slot = POLICY_SLOTS, TURN_OF_SLOT

    def __init__(self, timeout_pay: float = 1.0) -> None:
        self.timeout_pay = timeout_pay

    def reset(self, queries: torch.Tensor, rng: np.random.Generator, rare_prob: float) -> tuple[torch.Tensor, dict]:
        ctx = torch.full((len(queries), N_SLOTS), PAD, dtype=torch.long)
        ctx[:, 0] = queries
        timeout = on_default_device(rng.random(len(queries)) < rare_prob)
        return ctx, {"queries": queries, "timeout": timeout}

    def write(self, ctx: torch.Tensor, slot: int, info: dict) -> None:
        if slot == FLAG_SLOT:
            ctx[:, slot] = torch.where(info["timeout"], ERR, OK)
        elif slot in REPLY_SLOTS:
            ctx[:, slot] = torch.where(info["timeout"], ERR, RESULTS[ctx[:, CALL_SLOT]][:, REPLY_SLOTS.index(slot)])

    def tool_state(self, ctx: torch.Tensor, slot: int) -> torch.Tensor:
        return (ctx[:, FLAG_SLOT] == ERR) & (slot in ANSWER_SLOTS)

    def reward(self, ctx: torch.Tensor, info: dict) -> torch.Tensor:
        share = right_share(ctx[:, 0], ctx[:, list(ANSWER_SLOTS)])
        return torch.where(info["timeout"], self.timeout_pay * share, share)

    @staticmethod
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
        return torch.stack([RecoveryWorld.inputs(ctx, k) for k in range(len(POLICY_SLOTS))], 1)


def context_policy(hidden: int = HIDDEN) -> nn.Module:
    """A 2-hidden-layer tanh MLP from the visible context (one-hot slots) to logits over the digits."""
    return nn.Sequential(
        nn.Linear(N_INPUTS, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, N_DIGITS)
    )


# --- The gymnasium environment: tokens in, tokens out. ----------------------------------------------------
class ToolRecoveryEnv(gym.Env):
    """Call a tool, read its reply (or its timeout) as tokens, answer.

    Observation: the 9 slots of the episode so far (PAD where nothing is written yet). Action: the next
    digit the policy writes. Step 1 writes the call argument; the tool then writes its status flag and 3
    reply slots (a timeout, with probability `timeout_prob`, writes ERR in all four); steps 2-4 write the
    answer. The reward, at the last step, is the share of answer digits equal to the tool's result for the
    query, times `timeout_pay` after a timeout.
    """

    metadata = {"render_modes": []}

    def __init__(self, timeout_prob: float = TIMEOUT_BEFORE, timeout_pay: float = 1.0) -> None:
        self.timeout_prob = timeout_prob
        self.observation_space = gym.spaces.MultiDiscrete(np.full(N_SLOTS, N_SYMBOLS, dtype=np.int64))
        self.action_space = gym.spaces.Discrete(N_DIGITS)
        self._world, self._ctx, self._info, self._k = RecoveryWorld(timeout_pay), torch.empty(0), {}, 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        query = torch.tensor([int(self.np_random.integers(N_QUERIES))])
        self._ctx, self._info = self._world.reset(query, self.np_random, self.timeout_prob)
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
        info = {"tool_state": bool(self._ctx[0, FLAG_SLOT] == ERR)}
        return self._ctx[0].cpu().numpy().copy(), reward, done, False, info


ENV_ID = "stabench/ToolRecovery-v0"  # the id `ToolRecovery.environments` registers


# --- Warm start: copies usual replies, has no idea what to do after a timeout. ----------------------------
def _warm_up() -> nn.Module:
    """The policy after a short supervised warm-up (deterministic, one thread).

    Examples: the right call, the tool's reply, the right answer; in WARMUP_TIMEOUT of them the tool timed
    out and each answer target is the right digit with probability WARMUP_RECOVERY and a uniform random digit
    otherwise, so the policy there leans a little towards the recovery but is far from it.
    """
    with torch.random.fork_rng():
        torch.manual_seed(TABLE_SEED)
        model = context_policy()
        rng = np.random.default_rng(TABLE_SEED)
        optimizer = torch.optim.Adam(model.parameters(), lr=WARMUP_LR)
        world = RecoveryWorld()
        for _ in range(WARMUP_STEPS):
            queries = on_default_device(rng.integers(0, N_QUERIES, WARMUP_BATCH))
            ctx, info = world.reset(queries, rng, WARMUP_TIMEOUT)
            ctx[:, CALL_SLOT] = queries
            for s in (FLAG_SLOT, *REPLY_SLOTS):
                world.write(ctx, s, info)
            noise = on_default_device(rng.integers(0, N_DIGITS, (WARMUP_BATCH, 3)))
            practised = on_default_device(rng.random((WARMUP_BATCH, 3)) < WARMUP_RECOVERY)
            recovery = torch.where(practised, RESULTS[queries], noise)
            ctx[:, list(ANSWER_SLOTS)] = torch.where(info["timeout"][:, None], recovery, RESULTS[queries])
            logits = model(RecoveryWorld.inputs(ctx))
            targets = ctx[:, list(POLICY_SLOTS)]
            loss = nn.functional.cross_entropy(logits.reshape(-1, N_DIGITS), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model


warm_policy = WarmStart("tool-recovery", _warm_up, context_policy)


# --- Exact evaluation by enumeration. ---------------------------------------------------------------------
def _eval_contexts() -> tuple[torch.Tensor, ...]:
    """Every (query, call, timeout) context with its reply, and the answer prefixes to enumerate."""
    q, a, out = torch.meshgrid(torch.arange(N_QUERIES), torch.arange(N_DIGITS), torch.arange(2), indexing="ij")
    q, a, out = q.reshape(-1), a.reshape(-1), out.reshape(-1).bool()
    ctx = torch.full((len(q), N_SLOTS), PAD, dtype=torch.long)
    ctx[:, 0], ctx[:, CALL_SLOT] = q, a
    ctx[:, FLAG_SLOT] = torch.where(out, ERR, OK)
    ctx[:, list(REPLY_SLOTS)] = torch.where(out[:, None], ERR, RESULTS[a])
    n, d = len(ctx), N_DIGITS
    ctx2 = ctx.repeat_interleave(d, 0)
    ctx2[:, ANSWER_SLOTS[0]] = torch.arange(d).repeat(n)
    ctx3 = ctx.repeat_interleave(d * d, 0)
    ctx3[:, ANSWER_SLOTS[0]] = torch.arange(d).repeat_interleave(d).repeat(n)
    ctx3[:, ANSWER_SLOTS[1]] = torch.arange(d).repeat(d * n)
    inputs = [
        RecoveryWorld.inputs(ctx, 0),
        RecoveryWorld.inputs(ctx, 1),
        RecoveryWorld.inputs(ctx2, 2),
        RecoveryWorld.inputs(ctx3, 3),
    ]
    return q, a, out, torch.cat(inputs)


_Q, _A, _OUT, _EVAL_INPUTS = _eval_contexts()


@torch.no_grad()
def exact_returns(policy: nn.Module) -> tuple[float, float]:
    """(expected share of right digits after a usual reply, after a timeout) at temperature 1, exactly.

    Sums over the call argument and over every answer prefix: E[share of right digits] =
    mean over queries of sum_a pi(a | x) mean_i P(y_i = res[x]_i | x, a, reply).
    """
    n, d = len(_Q), N_DIGITS
    probs = torch.softmax(policy(_EVAL_INPUTS).double(), -1)
    p_call = probs[:n].gather(-1, _A[:, None]).squeeze(-1)  # pi(a | x)
    p1 = probs[n : 2 * n]  # [n, y1]
    p2 = probs[2 * n : 2 * n + n * d].view(n, d, d)  # [n, y1, y2]
    p3 = probs[2 * n + n * d :].view(n, d, d, d)  # [n, y1, y2, y3]
    target = RESULTS[_Q]  # [n, 3]
    right1 = p1.gather(-1, target[:, :1]).squeeze(-1)
    joint12 = p1[:, :, None] * p2  # P(y1, y2)
    right2 = (p1 * p2.gather(-1, target[:, 1, None, None].expand(n, d, 1)).squeeze(-1)).sum(-1)
    right3 = (joint12 * p3.gather(-1, target[:, 2, None, None, None].expand(n, d, d, 1)).squeeze(-1)).sum((1, 2))
    per_context = p_call * (right1 + right2 + right3) / 3
    usual = float(per_context[~_OUT].sum() / N_QUERIES)
    timeout = float(per_context[_OUT].sum() / N_QUERIES)
    return usual, timeout


def split_means(values: torch.Tensor, tool: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(mean over all masked tokens, over masked tool-state tokens, over masked text tokens); NaN where none."""
    values, mask, tool = values.detach().double(), mask.bool(), tool.bool()
    out = []
    for where in (mask, mask & tool, mask & ~tool):
        out.append(float(values[where].mean()) if bool(where.any()) else float("nan"))
    return out[0], out[1], out[2]


# --- Knobs. -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """What the task fixes; every field is a keyword argument of `ToolRecovery`."""

    onset: int | None = None  # None: the tier's onset (checked by `Task`)
    timeout_after: float = TIMEOUT_AFTER  # share of timeouts after onset (both branches)
    timeout_pay: float = TIMEOUT_PAY  # the injected branch's pay after a timeout, per unit of right digits

    def check(self, shortest_run: int) -> None:
        for name in ("timeout_after", "timeout_pay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise StabenchError(f"tool-recovery: {name} must be in [0, 1], got {value!r}")


# --- One run. ---------------------------------------------------------------------------------------------
class ToolRecoveryRun:
    """One seed under one method: the trainer (policy, optimizer, numpy Generator) and the branch's schedule."""

    def __init__(
        self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...], knobs: Knobs
    ) -> None:
        self.budget, self.diagnostics, self.knobs = budget, diagnostics, knobs
        self.trainer = ToolPPO(warm_policy(), RecoveryWorld(), replace(CONFIG, seed=seed), stabilizer)

    def step(self, injected: bool) -> dict[str, float]:
        shifted = self.trainer.iteration >= self.budget.onset  # both branches: timeouts become common
        timeout_prob = float(self.knobs.timeout_after) if shifted else TIMEOUT_BEFORE
        self.trainer.world.timeout_pay = float(self.knobs.timeout_pay) if injected and shifted else 1.0
        state = self.trainer.iterate(timeout_prob)
        usual, timeout = exact_returns(self.trainer.policy)
        batch, tool = state.batch, state.extras["tool_mask"]
        with torch.no_grad():
            entropy = categorical_entropy(self.trainer.policy(batch["inputs"]))  # after the update
        adv = state.extras["advantages"].abs()
        ent_all, ent_tool, ent_text = split_means(entropy, tool, batch["mask"])
        adv_all, adv_tool, adv_text = split_means(adv, tool, batch["mask"])
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": (1 - timeout_prob) * usual + timeout_prob * timeout,
            "entropy": ent_all,
            "entropy_tool": ent_tool,
            "entropy_text": ent_text,
            "adv_abs": adv_all,
            "adv_abs_tool": adv_tool,
            "adv_abs_text": adv_text,
            "return_tool": timeout,
            "return_text": usual,
            "timeout_share": timeout_prob,
            "reward": float(batch["rewards"].mean()),
            "tool_token_share": float(tool.float().mean()),
            "clip_frac": state.extras["clip_frac"],
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


def fig_recovery(table: pd.DataFrame, out: Path) -> list[Path]:
    panels = [
        ("return", "exact return"),
        ("return_tool", "return after a timeout"),
        ("entropy_tool", "tool-state entropy"),
    ]
    return fix_against_baseline(table, "tool-recovery", panels, out, "11_tool_recovery")


class ToolRecovery(Task):
    """See the module docstring."""

    id = "tool-recovery"
    family = "tools"
    version = "2"
    trainer = "tool-ppo"
    budgets = {
        "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=160, onset=20, seeds=5),
        "full": Budget(iterations=200, onset=40, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=0.8, fails_when="below", reduce="tail_mean", tail=0.25)
    matched_fix = "tool-state-groups"
    methods = ("baseline", "tool-state-groups", "advantage-clip", "grad-clip", "entropy-bonus")
    # a placeholder chosen by eye on design seeds 10-19: it alarms in both branches
    detector = DetectorSpec(metric="entropy_tool", threshold=0.6)
    diagnostics = ("ratio_tails",)
    provides = frozenset({"tool_mask"})
    # Floor: the policy frozen at onset, its exact post-onset return over calibration seeds 0-9; ceiling: the
    # control's post-onset mean return on the same seeds at the quick budget. Measured once and fixed.
    return_floor = 0.530
    return_ceiling = 0.941
    knobs_type = Knobs
    experimental = False
    environments = {"stabench/ToolRecovery-v0": "ToolRecoveryEnv"}
    figures = (
        Figure(
            "11_tool_recovery",
            "tool-recovery",
            "Exact return, return after a timeout and tool-state entropy on tool-recovery, baseline and matched fix.",
            fig_recovery,
        ),
    )
    paper = """On tool-recovery a tool's timeouts become common at onset in both branches, and the policy must
learn to recover (answer from the query alone), which it had barely practised. In the injected branch the
environment pays an answer after a timeout only a tenth of its right digits. Group-normalized advantages then
compare timed-out and usual episodes against one baseline: every token written after a timeout gets a large
negative advantage whatever it is, and the difference between a right and a wrong recovery is compressed to a
sliver of it. These large, uninformative updates on low-confidence tokens keep the tool-state distribution
moving without learning the recovery, while the text tokens stay right, so the aggregate return first tracks
the control's and then falls behind. Advantages normalized within the tool-state and text-state episodes of
each group (state-grouped advantages) learn the recovery as the control does (figure below)."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> ToolRecoveryRun:
        return ToolRecoveryRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs)
