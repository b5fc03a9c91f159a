"""rare-tool-states: a tool's rare reply format becomes common, and PPO against a mismatched sampler's log-probs
cannot learn it (version 4 meets the bar on seeds 0-9 and its failure-rate checks on fresh seeds 100-109; see
results/calibration.md).

The world (a gymnasium env, `stabench/RareToolStates-v0`, tokens in, tokens out). A query digit x (6 values);
the policy writes a call argument (right: x); the tool writes its reply into the sequence: a format flag
and the 3 digits res[x] of a fixed table; the policy reads the reply as tokens and writes a 3-digit answer,
paid the share of digits equal to res[x]. In the rare format (flag ALT) the tool writes every digit shifted
by one (mod 6), so copying the reply scores 0 and the policy must decode it. Tokens the policy writes after
a rare reply are the tool-state tokens. The world is shared with tool-recovery (`tasks/worlds/tools.py`); this
module says what the rare format writes (`ShiftedFormatWorld`).

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

import numpy as np
import pandas as pd
import torch
from stabench.baselines.models import SameWeights
from stabench.baselines.tool_ppo import ToolPPO, ToolPPOConfig
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, StabenchError, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import DiagnosedRun
from stabench.suite.figures import lines, need
from stabench.tasks.worlds import tools
from stabench.tasks.worlds.tokens import WarmStart, on_default_device
from stabench.tasks.worlds.tools import N_DIGITS, RARE, RESULTS, ToolEnv, ToolWorld, warm_up
from torch import nn

# --- The world (shared with tool-recovery: tasks/worlds/tools.py); this task's rare state. ------------------
ALT = RARE  # the rare format's flag
RARE_BEFORE = 0.02  # probability of the rare reply format before onset (and in the control throughout)
RARE_AFTER = 0.6  # ... after onset in the injected branch

# --- The warm start's rare share, the trainer. ------------------------------------------------------------
WARMUP_ALT = 0.1
TOOL_TEMPERATURE = 2.0
CONFIG = ToolPPOConfig(n_groups=12, group_size=8, lr=3e-3, epochs=4, minibatches=1)


class ShiftedFormatWorld(ToolWorld):
    """The tool world whose rare replies come in the shifted format (see the module docstring)."""

    @staticmethod
    def reply(digits: torch.Tensor, rare: torch.Tensor) -> torch.Tensor:
        """The reply digits: as they are in the usual format, each shifted by one (mod 6) in the rare one."""
        return torch.where(rare[:, None], (digits + 1) % N_DIGITS, digits)


# --- The gymnasium environment: tokens in, tokens out. ----------------------------------------------------
class ToolCallEnv(ToolEnv):
    """Call a tool, read its reply as tokens, answer (`ToolEnv`): the reply is in the rare shifted format with
    probability `rare_prob`; the reward, at the last step, is the share of answer digits equal to the tool's
    result for the query."""

    def __init__(self, rare_prob: float = RARE_BEFORE) -> None:
        super().__init__(ShiftedFormatWorld(), rare_prob)


ENV_ID = "stabench/RareToolStates-v0"  # the id `RareToolStates.environments` registers


# --- Warm start: a supervised agent that knows the usual format and has no idea about the rare one. -------
def _targets(queries: torch.Tensor, rare: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """The warm-up's answers: right after a usual reply, uniform random digits after a rare one."""
    noise = on_default_device(rng.integers(0, N_DIGITS, (len(queries), 3)))
    return torch.where(rare[:, None], noise, RESULTS[queries])


def _warm_up() -> nn.Module:
    """The policy after a short supervised warm-up in which WARMUP_ALT of the replies are in the rare format with
    random answer targets, so the policy is near-uniform there (`tools.warm_up`)."""
    return warm_up(ShiftedFormatWorld(), WARMUP_ALT, _targets)


# shipped as tasks/warm_starts/rare-tool-states.safetensors (after changing the warm-up: stabench warm-start --retrain)
warm_policy = WarmStart("rare-tool-states", _warm_up, tools.context_policy,
                        sha256="59236982a23666e8f55fd85c4fb062e1dc119b0b8ad5f6a798e3676d9731cc87")

# --- Exact evaluation by enumeration: (expected reward in the usual format, in the rare format). ------------
exact_returns = tools.ExactReturns(ShiftedFormatWorld())


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
class RareToolStatesRun(DiagnosedRun):
    """One seed under one method: the trainer (policy, optimizer, numpy Generator) and the branch's schedule."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 knobs: Knobs) -> None:
        self.budget, self.diagnostics, self.knobs = budget, diagnostics, knobs
        config = replace(CONFIG, seed=seed, tool_temperature=1.0)  # an exact sampler until the injection
        self.trainer = ToolPPO(warm_policy(), ShiftedFormatWorld(), config, stabilizer)
        self.evaluate = SameWeights()  # the exact returns, computed again only when the policy changed

    def train(self, injected: bool) -> tuple[dict[str, float], TrainState]:
        shifted = self.trainer.iteration >= self.budget.onset  # both branches: the rare format becomes common
        rare_prob = float(self.knobs.rare_after) if shifted else RARE_BEFORE
        temperature = float(self.knobs.tool_temperature) if injected and shifted else 1.0  # the injection
        if self.trainer.config.tool_temperature != temperature:
            self.trainer.config = replace(self.trainer.config, tool_temperature=temperature)
        state = self.trainer.iterate(rare_prob)
        usual, rare = self.evaluate(exact_returns, self.trainer.policy)
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
        return row, state


def fig_tool_ratios(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    rows = need(table, "rare-tool-states", "ratio_p99_tool", "ratio_p99_text")
    return lines(rows, "ratio_p99_tool", "importance-ratio p99 in tool states", out, name)


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
        Figure("ratio-tails", "tool-state ratio tails",
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


