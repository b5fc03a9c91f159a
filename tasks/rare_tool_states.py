"""rare-tool-states: a tool's rare reply format becomes common, and PPO against a mismatched sampler's log-probs
cannot learn it (EXPERIMENTAL in version 3: it meets the bar on seeds 0-9 but its control fails 2/10 on the
fresh seeds 100-109, numbers below).

The world (a gymnasium env, `stabench/RareToolStates-v0`, tokens in, tokens out). A query digit x (6 values);
the policy writes a call argument (right: x); the tool writes its reply into the sequence: a format flag
and the 3 digits res[x] of a fixed table; the policy reads the reply as tokens and writes a 3-digit answer,
paid the share of digits equal to res[x]. In the rare format (flag ALT) the tool writes every digit shifted
by one (mod 6), so copying the reply scores 0 and the policy must decode it. Tokens the policy writes after
a rare reply are the tool-state tokens.

Policy and trainer. A 2 x 64 tanh MLP over the one-hot context (the slots written so far) emits the digits;
it starts from a supervised warm-up that knows the usual format and, having seen rare replies only with
random targets, is near-uniform in the tool state (exact rare-format return 0.19, usual 0.999).
`baselines/tool_ppo.py`: 12 queries x 8 episodes per iteration, group-normalized outcome advantages, 4
epochs over each rollout (reuse), Adam 3e-3, clip 0.2, no KL or entropy term. The sampler logs its own
log-probs, and the baseline forms the PPO ratio against them, as an asynchronous pipeline that reuses the
engine's log-probs does.

What must be learned after onset (issue 12 "not learning must not win"). At onset (iteration 20 of 120 at
quick) the rare format goes from 2% of the replies to 60% in BOTH branches: the new problem is to decode the
shifted reply. The policy at onset scores 0.12-0.25 on the rare format (seeds 0-9), so its post-onset return
is 0.47-0.55; the optimum is 1. The injection (injected branch only, from onset): the sampler draws
tool-state tokens at temperature 2 (a sampling/training mismatch confined to tool turns; on text tokens the
sampler is the policy); before onset and in the control the sampler is the policy. Version 1 had the
mismatch in every branch from the start and the shift in the injected branch only, so its control had
nothing left to learn after onset; version 2 moved the shift into both branches and made the mismatch the
injection; version 3 (this one) gives the post-onset phase 100 iterations instead of 60 (quick 120
iterations, onset 20) and makes the token-level truncated IS (`token-tis`) the matched fix, since that is
what measurably works (turn-is stays as a named variant).

Ground truth: the exact expected reward of the trained policy (temperature 1), by enumeration over the
call and every answer prefix, under the branch's current rare share; failure = its mean over the last 25%
of the run (quick: iterations 90-119) below 0.8. With 60% rare replies a policy that never learns the rare
format scores at most 0.4 + 0.6 x its rare-format score, so 0.8 means it gets at least two thirds of the
rare-format digits right; the policy frozen at onset scores 0.47-0.55 and fails on every seed.

Normalized return: `return_floor` = 0.503 is the exact post-onset return of the policy FROZEN AT ONSET (the
`frozen-at-onset` reference; exact by enumeration per seed, averaged over calibration seeds 0-9 at the
version-3 budget: 0.51 0.48 0.52 0.47 0.50 0.54 0.50 0.49 0.47 0.55, unchanged from version 2 since the onset
is), measured once and fixed. `return_ceiling` = 0.826 is what the control reaches: the baseline's control's
post-onset mean return (iterations 20-119) averaged over seeds 0-9 (0.77-0.90 per seed), measured once and
fixed; the exact optimum 1 is not reached within 100 updates (the control's tail is 0.88-0.96).
Seeds each setting was chosen on: the world, the trainer, the rare shares (0.02 / 0.6), the temperature 2 and
the 0.8 threshold are version 1's, chosen on seeds 0-4; the 120-iteration budget and token-tis as the matched
fix were chosen on seeds 0-9 (a probe with plain `run_trial` in version 2's session, then this calibration);
the floor and ceiling on seeds 0-9; the detector threshold on seeds 100-109 only.

Calibration, version 3 (quick tier: 120 iterations, onset 20; seeds 0-9; tail = iterations 90-119):
| method | failed (injected) | control failed | normalized return [95% CI] | injected tail return, seeds 0-9 |
|---|---|---|---|---|
| baseline | 10/10 | 0/10 | 0.233 [0.211, 0.255] | 0.61 0.61 0.60 0.63 0.62 0.61 0.60 0.62 0.59 0.62 |
| token-tis (fix) | 0/10 | 1/10 | 0.998 [0.901, 1.086] | 0.90 1.00 0.93 0.93 0.90 0.81 0.90 0.90 0.90 0.90 |
| turn-is | 3/10 | 3/10 | 0.716 [0.495, 0.925] | 0.95 0.83 0.93 0.87 0.73 0.63 0.53 0.83 0.82 0.87 |
| tool-dual-clip | 10/10 | 0/10 | 0.233 [0.211, 0.255] | as the baseline at two decimals |
| frozen-at-onset | 10/10 | 10/10 | 0.000 [-0.048, 0.051] | 0.47-0.55 (the onset policy) |
| no-update | 10/10 | 10/10 | 0.027 [0.027, 0.027] | 0.51 (the warm start) |
The baseline's control tails: 0.96 0.90 0.93 0.95 0.89 0.89 0.93 0.88 0.89 0.93 (control normalized 1.00 by
construction of the ceiling); token-tis's own control fails on seed 7 (0.76). `stabench score --calibration`:
bar met on seeds 0-9.
Fresh seeds 100-109 (nobody tuned on them):
| method | failed (injected) | control failed | normalized return [95% CI] |
|---|---|---|---|
| baseline | 10/10 | 2/10 | 0.256 [0.237, 0.277] |
| token-tis (fix) | 0/10 | 1/10 | 1.038 [0.956, 1.132] |
| frozen-at-onset | 10/10 | 10/10 | 0.002 [-0.113, 0.119] |
| no-update | 10/10 | 10/10 | 0.027 [0.027, 0.027] |
Tails on seeds 100-109: baseline 0.59-0.64; its control 0.93 0.96 0.88 0.83 0.96 0.79 0.80 0.96 0.96 0.89 (fails
on seeds 105 and 106, 0.79 and 0.80, still learning the rare format at iteration 120); token-tis 0.89-0.97
(its control fails on seed 106, 0.80). `stabench score --calibration`: "missed: control healthy".

Why EXPERIMENTAL: the default suite asks every failure-rate check to hold on seeds 100-109 too; the control
fails 2/10 there (> 10%), both misses by a hair (0.79, 0.80 against 0.8): the control is slow, not broken.
Everything else holds on both seed sets (baseline 10/10, fix 0/10 and 100 points below, references 10/10).
Not tried, because it would be chosen after looking at the fresh seeds: a longer post-onset phase (e.g. 160
iterations); it needs a new fresh-seed set to check. Version 2 (80 iterations) had the control failing 2/10
and turn-is 6/10 on seeds 0-9.

Mechanism, as measured (seeds 0-9, tail = iterations 90-119). At onset every branch drops to 0.47-0.55. The
baseline then stalls: its ratio pi_theta / q on a tool-state token starts at pi_old / q != 1, so on the tokens
the policy already prefers (pi_old > q under a flatter sampler) r > 1.2 from the first epoch and every
positive-advantage update is clipped to zero, while on tokens it disprefers negative-advantage updates are
clipped (r < 0.8): the policy cannot become confident in the tool state. Tail return 0.59-0.63 (rare-format
return 0.32-0.38), control 0.88-0.96; its token entropy stays HIGH (0.72-0.76 in the tail, control
0.02-0.08): not an entropy collapse, the policy is held near the sampler's flattened distribution; median
post-onset clip fraction 0.19-0.25 (control 0.00-0.02). `tool-dual-clip` (the plain guard, c = 3) equals the
baseline to two decimals on every seed: ratios on negative advantages never reach 3 (tool-state ratio p99
1.56-1.68). The failure is not a ratio blow-up; correcting the sampler's log-probs token by token is what
helps: token-tis (ratio against the recomputed pi_old, detached weight min(pi_old / q, 2) per token) learns
the rare format (rare-format tail return 0.70-1.00, entropy 0.01-0.08) as fast as the control (normalized
1.00). The turn-level weight (turn-is) is worse: it fails 3/10 (seeds 4, 5, 6: 0.73, 0.63, 0.53) and so
does its own control, where the sampler is exact (seeds 1, 5, 7: 0.73, 0.80, 0.76; not diagnosed); on its
failing seeds it settles on a deterministic partial decoding (entropy 0.00-0.14, rare-format return
0.22-0.55).

Fixes: `token-tis` (matched fix: decoupled PPO / truncated IS, weight min(pi_old / q, 2) per token);
`turn-is` (variant, SORL-style: the ratio against the recomputed pi_old, a detached turn-level truncated
weight min(prod_{t in turn} pi_old / q, 2), clipping-bias normalization). Version 1 also measured SORL's
geometric-mean turn weight (5/5 failed) and the Turn-PPO turn-level ratio (2/5 failed).

Diagnostics. Tool-state ratio p99 is 1.5-1.7 in the injected branch after onset and 1.0-1.4 in the control (4
epochs of reuse alone), text-state p99 1.00. The clip fraction is the default detector: on seeds 100-109
(baseline runs, version 3) it is at most 0.08 before onset, the injected branch reaches 0.20-0.47 at its first
post-onset iteration, the control's maximum per seed is 0.09-0.33. The threshold 0.27 was chosen ONLY on
those runs: the injected branch crosses it at onset or one iteration later on 10/10 seeds, the control on
1/10; 0.25 would alarm on 2 controls, 0.33 misses the injected branch on one seed and crosses late (57, 108)
on two. It flags the shift of the batch into mismatched states at onset, not which method will recover.

Suite 0.3.0 re-measured seeds 0-9 and 100-109: `token-tis` is now one implementation with PPO's decoupled
objective, `tool-dual-clip` is the one `dual-clip`, and every return of every method equals 0.2.0's bit for
bit (verdict unchanged: the control fails 2/10 on fresh seeds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import gymnasium as gym
import numpy as np
import torch
from stabench.baselines.tool_ppo import ToolPPO, ToolPPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.tokens import on_default_device, warm_start
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


ENV_ID = "stabench/RareToolStates-v0"  # registered by `stabench.tasks`


# --- Warm start: a supervised agent that knows the usual format and has no idea about the rare one. -------
_WARM_STATE: dict[str, torch.Tensor] = {}


def _warm_up() -> nn.Module:
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


def warm_policy() -> nn.Module:
    """The policy after a short supervised warm-up (deterministic, one thread; cached by `warm_start`).

    Examples: the right call, the tool's reply, the right answer; in WARMUP_ALT of them the reply is in the
    rare format and the answer targets are uniform random digits, so the policy is near-uniform there.
    """
    if not _WARM_STATE:
        _WARM_STATE.update(warm_start("rare-tool-states", _warm_up, __file__))
    model = context_policy()
    model.load_state_dict(_WARM_STATE)
    return model


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

    onset: int | None = None  # None: the tier's onset
    rare_after: float = RARE_AFTER  # share of rare replies after onset (injected branch)
    tool_temperature: float = TOOL_TEMPERATURE  # the sampler's temperature on tool-state tokens

    def check(self, iterations: int) -> None:
        if self.onset is not None:
            if isinstance(self.onset, bool) or not isinstance(self.onset, int):
                raise StabenchError(f"rare-tool-states: onset must be an integer, got {self.onset!r}")
            if not 0 < self.onset < iterations:
                raise StabenchError(f"rare-tool-states: onset {self.onset} must lie strictly inside the run of "
                                    f"{iterations} iterations")
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


class RareToolStates(Task):
    """See the module docstring."""

    id = "rare-tool-states"
    family = "tools"
    version = "3"
    trainer = "tool-ppo"
    budgets = {
        "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=120, onset=20, seeds=5),
        "full": Budget(iterations=160, onset=40, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=0.8, fails_when="below", reduce="tail_mean", tail=0.25)
    matched_fix = "token-tis"
    methods = ("baseline", "token-tis", "turn-is", "dual-clip")
    # Clip fraction: at most 0.08 before onset; the control up to 0.33, the injected baseline 0.20-0.47 at onset.
    detector = DetectorSpec(metric="clip_frac", threshold=0.27)  # chosen on seeds 100-109 only (docstring)
    diagnostics = ("ratio_tails",)
    # Floor: the policy frozen at onset, its exact post-onset return averaged over calibration seeds 0-9;
    # ceiling: the control's post-onset mean return on the same seeds at the 120-iteration budget (the exact
    # optimum, 1, is not reached in 100 updates). Both measured once and fixed (see the docstring).
    return_floor = 0.503
    return_ceiling = 0.826
    knobs_type = Knobs
    experimental = True  # bar met on seeds 0-9; on seeds 100-109 the control fails 2/10 (see the docstring)

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> RareToolStatesRun:
        return RareToolStatesRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs)


