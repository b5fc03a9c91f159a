"""rare-tool-states: a tool's rare reply format becomes common, and PPO against a mismatched sampler's log-probs
cannot learn it (version 4 meets the bar on seeds 0-9 and its failure-rate checks on fresh seeds 100-109; see
results/calibration.md).

The world (a gymnasium env, `stabench/RareToolStates-v0`, tokens in, tokens out). A query digit x (6 values);
the policy writes a call argument (right: x); the tool writes its reply into the sequence: a format flag
and the 3 digits res[x] of a fixed table; the policy reads the reply as tokens and writes a 3-digit answer,
paid the share of digits equal to res[x]. In the rare format (flag ALT) the tool writes every digit shifted
by one (mod 6), so copying the reply scores 0 and the policy must decode it. Tokens the policy writes after
a rare reply are the tool-state tokens.

Policy and trainer. A 2 x 64 tanh MLP over the one-hot context (the slots written so far) emits the digits;
it starts from a supervised warm-up that knows the usual format and, having seen rare replies only with
random targets, is near-uniform in the tool state. `baselines/tool_ppo.py`: 12 queries x 8 episodes per
iteration, group-normalized outcome advantages, 4 epochs over each rollout (reuse), Adam 3e-3, clip 0.2, no
KL or entropy term. The sampler logs its own log-probs, and the baseline forms the PPO ratio against them,
as an asynchronous pipeline that reuses the engine's log-probs does.

What must be learned after onset. At onset (iteration 20 of 180 at quick) the rare format goes from 2% of
the replies to 60% in BOTH branches: the new problem is to decode the shifted reply, which the policy at
onset cannot; the optimum is 1. The injection (injected branch only, from onset): the sampler draws
tool-state tokens at temperature 2 (a sampling/training mismatch confined to tool turns; on text tokens the
sampler is the policy); before onset and in the control the sampler is the policy.

Ground truth: the exact expected reward of the trained policy (temperature 1), by enumeration over the
call and every answer prefix, under the branch's current rare share; failure = its mean over the last 25%
of the run below 0.8. With 60% rare replies a policy that never learns the rare format scores at most
0.4 + 0.6 x its rare-format score, so 0.8 means it gets at least two thirds of the rare-format digits right.

Normalized return: `return_floor` is the exact post-onset return of the policy FROZEN AT ONSET (the
`frozen-at-onset` reference), `return_ceiling` what the baseline's control reaches after onset (the exact
optimum 1 is not reached within 160 updates); both averaged over calibration seeds 0-9 at the quick budget,
measured once and fixed. Seeds each setting was chosen on: the world, the trainer, the rare shares (0.02 /
0.6), the temperature 2 and the 0.8 threshold on seeds 0-4; token-tis as the matched fix on seeds 0-9; the
quick budget (version 4: 180 iterations, onset 20, i.e. 160 post-onset updates instead of version 3's 100)
on seeds 0-9 and design seeds 10-29, with the baseline and token-tis run to 200 iterations (every shorter
budget is a prefix): of 140, 160, 180 and 200, 180 is the shortest at which no baseline control's tail falls
more than about 0.03 short of its tail at 200 (the controls that stall on a partial decoding and escape late
have finished by then; a control that stalls for good is not helped by any length). The longer phase
was tried BECAUSE version 3's control missed on seeds 100-109, so those seeds checked a remedy suggested by
their own miss. The floor and the ceiling on seeds 0-9; the detector threshold on seeds 100-109 only
(version 3's runs). The measured numbers are in results/calibration.md.

Mechanism. At onset every branch's return drops. The baseline's ratio pi_theta / q on a tool-state token
starts at pi_old / q != 1, so on the tokens the policy already prefers (pi_old > q under a flatter sampler)
r > 1.2 from the first epoch and every positive-advantage update is clipped to zero, while on tokens it
disprefers negative-advantage updates are clipped (r < 0.8): the policy cannot become confident in the tool
state. Its token entropy stays high (not an entropy collapse: the policy is held near the sampler's
flattened distribution) and its clip fraction rises. The failure is not a ratio blow-up, so `dual-clip`
(c = 3) does not help: ratios on negative advantages never reach 3. Correcting the sampler's log-probs
token by token does: `token-tis` learns the rare format as fast as the control.

Fixes: `token-tis` (matched fix: decoupled PPO / truncated IS, the ratio against the recomputed pi_old and a
detached weight min(pi_old / q, 2) per token); `turn-is` (variant, SORL-style: a detached turn-level
truncated weight min(prod_{t in turn} pi_old / q, 2), clipping-bias normalization), weaker than the
token-level weight.

Diagnostics. `ratio_tails`: importance-ratio tails (p99, ESS) on tool-state and text tokens; the tool-state
tails widen in the injected branch after onset. The clip fraction is the default detector, threshold 0.27
chosen ONLY on the baseline's runs on seeds 100-109: it flags the shift of the batch into mismatched states
at onset, not which method will recover.
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
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.suite.figures import lines, need
from stabench.tasks.worlds.tokens import WarmStart, on_default_device
from torch import nn

# --- The world. --------------------------------------------------------------------------------------------
N_DIGITS = 6  # the policy emits digits 0..5; queries are digits too
N_QUERIES = N_DIGITS
OK, ALT, PAD = N_DIGITS, N_DIGITS + 1, N_DIGITS + 2  # reply flags and padding
N_SYMBOLS = N_DIGITS + 3
# Slots: 0 query x | 1 call argument a (policy) | 2 reply flag | 3-5 reply digits | 6-8 answer (policy).
N_SLOTS = 9
CALL_SLOT, FLAG_SLOT, REPLY_SLOTS, ANSWER_SLOTS = 1, 2, (3, 4, 5), (6, 7, 8)
POLICY_SLOTS = (CALL_SLOT, *ANSWER_SLOTS)
TURN_OF_SLOT = (0, 1, 1, 1)  # turn 0: the call; turn 1: the answer
TABLE_SEED = 0
N_INPUTS = N_SLOTS * N_SYMBOLS + len(POLICY_SLOTS)
_SLOTS = torch.arange(N_SLOTS)
RARE_BEFORE = 0.02  # probability of the rare reply format before onset (and in the control throughout)
RARE_AFTER = 0.6  # ... after onset in the injected branch

# --- The policy, its warm start, the trainer. -------------------------------------------------------------
HIDDEN = 64
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR, WARMUP_ALT = 300, 128, 1e-2, 0.1
TOOL_TEMPERATURE = 2.0
CONFIG = ToolPPOConfig(n_groups=12, group_size=8, lr=3e-3, epochs=4, minibatches=1)


def result_table() -> torch.Tensor:
    """res[x]: the 3 digits the tool returns for argument x (fixed per task version), LongTensor [N_QUERIES, 3]."""
    rng = np.random.default_rng(TABLE_SEED)
    return on_default_device(rng.integers(0, N_DIGITS, (N_QUERIES, 3)))


RESULTS = result_table()


def encode(digits: torch.Tensor, alt: torch.Tensor) -> torch.Tensor:
    """The tool's reply digits: as they are in the usual format, each shifted by one (mod 6) in the rare one."""
    return torch.where(alt[:, None], (digits + 1) % N_DIGITS, digits)


def answer_reward(queries: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Share of the 3 answer digits equal to res[query] (the tool's result for the query, in the usual format)."""
    return (answers == RESULTS[queries]).float().mean(1)


class ToolWorld:
    """The batched environment the trainer drives (see baselines/tool_ppo.py for the protocol)."""

    n_slots, n_actions, n_queries = N_SLOTS, N_DIGITS, N_QUERIES
    policy_slots, turn_of_slot = POLICY_SLOTS, TURN_OF_SLOT

    def reset(self, queries: torch.Tensor, rng: np.random.Generator, rare_prob: float) -> tuple[torch.Tensor, dict]:
        ctx = torch.full((len(queries), N_SLOTS), PAD, dtype=torch.long)
        ctx[:, 0] = queries
        alt = on_default_device(rng.random(len(queries)) < rare_prob)
        return ctx, {"queries": queries, "alt": alt}

    def write(self, ctx: torch.Tensor, slot: int, info: dict) -> None:
        if slot == FLAG_SLOT:
            ctx[:, slot] = torch.where(info["alt"], ALT, OK)
        elif slot in REPLY_SLOTS:
            ctx[:, slot] = encode(RESULTS[ctx[:, CALL_SLOT]], info["alt"])[:, REPLY_SLOTS.index(slot)]

    def tool_state(self, ctx: torch.Tensor, slot: int) -> torch.Tensor:
        return (ctx[:, FLAG_SLOT] == ALT) & (slot in ANSWER_SLOTS)

    def reward(self, ctx: torch.Tensor, info: dict) -> torch.Tensor:
        return answer_reward(ctx[:, 0], ctx[:, list(ANSWER_SLOTS)])

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
        return torch.stack([ToolWorld.inputs(ctx, k) for k in range(len(POLICY_SLOTS))], 1)


def context_policy(hidden: int = HIDDEN) -> nn.Module:
    """A 2-hidden-layer tanh MLP from the visible context (one-hot slots) to logits over the digits."""
    return nn.Sequential(nn.Linear(N_INPUTS, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, N_DIGITS))


# --- The gymnasium environment: tokens in, tokens out. ----------------------------------------------------
class ToolCallEnv(gym.Env):
    """Call a tool, read its reply as tokens, answer.

    Observation: the 9 slots of the episode so far (PAD where nothing is written yet). Action: the next
    digit the policy writes. Step 1 writes the call argument; the tool then writes its reply (flag and 3
    digits, in the rare shifted format with probability `rare_prob`); steps 2-4 write the answer. The
    reward, at the last step, is the share of answer digits equal to the tool's result for the query.
    """

    metadata = {"render_modes": []}

    def __init__(self, rare_prob: float = RARE_BEFORE) -> None:
        self.rare_prob = rare_prob
        self.observation_space = gym.spaces.MultiDiscrete(np.full(N_SLOTS, N_SYMBOLS, dtype=np.int64))
        self.action_space = gym.spaces.Discrete(N_DIGITS)
        self._world, self._ctx, self._info, self._k = ToolWorld(), torch.empty(0), {}, 0

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
        info = {"tool_state": bool(self._ctx[0, FLAG_SLOT] == ALT)}
        return self._ctx[0].cpu().numpy().copy(), reward, done, False, info


ENV_ID = "stabench/RareToolStates-v0"  # the id `RareToolStates.environments` registers


# --- Warm start: a supervised agent that knows the usual format and has no idea about the rare one. -------
def _warm_up() -> nn.Module:
    """The policy after a short supervised warm-up (deterministic, one thread).

    Examples: the right call, the tool's reply, the right answer; in WARMUP_ALT of them the reply is in the
    rare format and the answer targets are uniform random digits, so the policy is near-uniform there.
    """
    with torch.random.fork_rng():
        torch.manual_seed(TABLE_SEED)
        model = context_policy()
        rng = np.random.default_rng(TABLE_SEED)
        optimizer = torch.optim.Adam(model.parameters(), lr=WARMUP_LR)
        for _ in range(WARMUP_STEPS):
            queries = on_default_device(rng.integers(0, N_QUERIES, WARMUP_BATCH))
            ctx, info = ToolWorld().reset(queries, rng, WARMUP_ALT)
            ctx[:, CALL_SLOT] = queries
            for s in (FLAG_SLOT, *REPLY_SLOTS):
                ToolWorld().write(ctx, s, info)
            noise = on_default_device(rng.integers(0, N_DIGITS, (WARMUP_BATCH, 3)))
            ctx[:, list(ANSWER_SLOTS)] = torch.where(info["alt"][:, None], noise, RESULTS[queries])
            logits = model(ToolWorld.inputs(ctx))
            targets = ctx[:, list(POLICY_SLOTS)]
            loss = nn.functional.cross_entropy(logits.reshape(-1, N_DIGITS), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model


warm_policy = WarmStart("rare-tool-states", _warm_up, context_policy)


# --- Exact evaluation by enumeration. ---------------------------------------------------------------------
def _eval_contexts() -> tuple[torch.Tensor, ...]:
    """Every (query, call, format) context with its reply, and the answer prefixes to enumerate."""
    q, a, alt = torch.meshgrid(torch.arange(N_QUERIES), torch.arange(N_DIGITS), torch.arange(2), indexing="ij")
    q, a, alt = q.reshape(-1), a.reshape(-1), alt.reshape(-1).bool()
    ctx = torch.full((len(q), N_SLOTS), PAD, dtype=torch.long)
    ctx[:, 0], ctx[:, CALL_SLOT] = q, a
    ctx[:, FLAG_SLOT] = torch.where(alt, ALT, OK)
    ctx[:, list(REPLY_SLOTS)] = encode(RESULTS[a], alt)
    n, d = len(ctx), N_DIGITS
    ctx2 = ctx.repeat_interleave(d, 0)
    ctx2[:, ANSWER_SLOTS[0]] = torch.arange(d).repeat(n)
    ctx3 = ctx.repeat_interleave(d * d, 0)
    ctx3[:, ANSWER_SLOTS[0]] = torch.arange(d).repeat_interleave(d).repeat(n)
    ctx3[:, ANSWER_SLOTS[1]] = torch.arange(d).repeat(d * n)
    inputs = [ToolWorld.inputs(ctx, 0), ToolWorld.inputs(ctx, 1), ToolWorld.inputs(ctx2, 2), ToolWorld.inputs(ctx3, 3)]
    return q, a, alt, torch.cat(inputs)


_Q, _A, _ALT, _EVAL_INPUTS = _eval_contexts()


@torch.no_grad()
def exact_returns(policy: nn.Module) -> tuple[float, float]:
    """(expected reward in the usual format, in the rare format) of the policy at temperature 1, exactly.

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
    usual = float(per_context[~_ALT].sum() / N_QUERIES)
    rare = float(per_context[_ALT].sum() / N_QUERIES)
    return usual, rare


# --- Knobs. -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """What the task fixes; every field is a keyword argument of `RareToolStates`."""

    onset: int | None = None  # None: the tier's onset (checked by `Task`)
    rare_after: float = RARE_AFTER  # share of rare replies after onset (injected branch)
    tool_temperature: float = TOOL_TEMPERATURE  # the sampler's temperature on tool-state tokens

    def check(self, shortest_run: int) -> None:
        if not isinstance(self.rare_after, (int, float)) or not 0.0 <= self.rare_after <= 1.0:
            raise StabenchError(f"rare-tool-states: rare_after must be a probability, got {self.rare_after!r}")
        if not isinstance(self.tool_temperature, (int, float)) or not self.tool_temperature > 0:
            raise StabenchError(f"rare-tool-states: tool_temperature must be > 0, got {self.tool_temperature!r}")


# --- One run. ---------------------------------------------------------------------------------------------
class RareToolStatesRun:
    """One seed under one method: the trainer (policy, optimizer, numpy Generator) and the branch's schedule."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 knobs: Knobs) -> None:
        self.budget, self.diagnostics, self.knobs = budget, diagnostics, knobs
        config = replace(CONFIG, seed=seed, tool_temperature=1.0)  # an exact sampler until the injection
        self.trainer = ToolPPO(warm_policy(), ToolWorld(), config, stabilizer)

    def step(self, injected: bool) -> dict[str, float]:
        shifted = self.trainer.iteration >= self.budget.onset  # both branches: the rare format becomes common
        rare_prob = float(self.knobs.rare_after) if shifted else RARE_BEFORE
        temperature = float(self.knobs.tool_temperature) if injected and shifted else 1.0  # the injection
        if self.trainer.config.tool_temperature != temperature:
            self.trainer.config = replace(self.trainer.config, tool_temperature=temperature)
        state = self.trainer.iterate(rare_prob)
        usual, rare = exact_returns(self.trainer.policy)
        tool = state.extras["tool_mask"]
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": (1 - rare_prob) * usual + rare_prob * rare,
            "entropy": state.extras["entropy"],
            "return_tool": rare,
            "return_text": usual,
            "rare_share": rare_prob,
            "reward": float(state.batch["rewards"].mean()),
            "tool_token_share": float(tool.float().mean()),
            "clip_frac": state.extras["clip_frac"],
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


def fig_tool_ratios(table: pd.DataFrame, out: Path) -> list[Path]:
    rows = need(table, "rare-tool-states", "ratio_p99_tool", "ratio_p99_text")
    return lines(rows, "ratio_p99_tool", "importance-ratio p99 in tool states", out, "10_tool_ratio_tails")


class RareToolStates(Task):
    """See the module docstring."""

    id = "rare-tool-states"
    family = "tools"
    version = "4"
    trainer = "tool-ppo"
    budgets = {
        "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=180, onset=20, seeds=5),
        "full": Budget(iterations=240, onset=40, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=0.8, fails_when="below", reduce="tail_mean", tail=0.25)
    matched_fix = "token-tis"
    methods = ("baseline", "token-tis", "turn-is", "dual-clip")
    detector = DetectorSpec(metric="clip_frac", threshold=0.27)  # chosen on seeds 100-109 only (docstring)
    diagnostics = ("ratio_tails",)
    # Floor: the policy frozen at onset, its exact post-onset return averaged over calibration seeds 0-9;
    # ceiling: the control's post-onset mean return on the same seeds at the 180-iteration budget (the exact
    # optimum, 1, is not reached in 160 updates). Both measured once and fixed (version 4; see the docstring).
    return_floor = 0.503
    return_ceiling = 0.864
    knobs_type = Knobs
    experimental = False  # version 4: bar met on seeds 0-9 and the failure-rate checks on 100-109 (calibration.md)
    environments = {"stabench/RareToolStates-v0": "ToolCallEnv"}
    figures = (
        Figure("10_tool_ratio_tails", "tool-state ratio tails",
               "Importance-ratio p99 in tool states on rare-tool-states.", fig_tool_ratios),
    )
    paper = """On rare-tool-states a tool's reply comes in a rare, shifted format that becomes common at onset in
both branches, so the policy must learn to decode it. In the injected branch an asynchronous sampler draws the
tokens after such a reply at a higher temperature than the policy, and PPO forms its ratio against the
sampler's log-probs: on those tool-state tokens the ratio starts away from 1, clipping cancels the updates
that would make the policy confident, and the baseline stays near the sampler's flattened distribution
without its ratios ever blowing up (so dual clipping does not help). Token-level truncated importance
sampling, which forms the ratio against the recomputed old policy and weights each token by its truncated
old-policy-to-sampler ratio, learns the rare format as the control does (figure below)."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> RareToolStatesRun:
        return RareToolStatesRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs)


