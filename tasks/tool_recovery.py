"""tool-recovery: tool timeouts become common, and group advantages put an uninformative push on the
low-confidence tokens written after them (see results/calibration.md).

The world (a gymnasium env, `stabench/ToolRecovery-v0`, tokens in, tokens out). A query digit x (6 values);
the policy writes a call argument (right: x); the tool writes its reply into the sequence: a status flag
and 3 reply slots. A usual reply (flag OK) carries the 3 digits res[x] of a fixed table, and the policy
copies them into its 3-digit answer. A timeout (flag ERR) carries no result (the 3 slots read ERR), and
the right recovery is to answer res[x] from the query alone, which the policy has seldom practised. Paid:
the share of answer digits equal to res[x]. Tokens the policy writes after a timeout are the tool-state
tokens (`tool_mask` in the batch, `turn` 1 with the answer). The world is shared with rare-tool-states
(`tasks/worlds/tools.py`); this module says what a timeout writes and pays (`TimeoutWorld`).

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

import numpy as np
import pandas as pd
import torch
from stabench.baselines.models import SameWeights
from stabench.baselines.tool_ppo import ToolPPO, ToolPPOConfig
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, StabenchError, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import DiagnosedRun, categorical_entropy
from stabench.suite.figures import fix_against_baseline
from stabench.tasks.worlds import tools
from stabench.tasks.worlds.tokens import WarmStart, on_default_device
from stabench.tasks.worlds.tools import RARE, RESULTS, ToolEnv, ToolWorld, warm_up
from torch import nn

# --- The world (shared with rare-tool-states: tasks/worlds/tools.py); this task's rare state. ---------------
ERR = RARE  # a timeout's flag, also what its empty reply slots read
TIMEOUT_BEFORE = 0.02  # probability of a timeout before onset
TIMEOUT_AFTER = 0.6  # ... after onset, both branches
TIMEOUT_PAY = 0.1  # the injected branch's pay for an answer after a timeout, per unit of right digits

# --- The warm start's shares, the trainer. ----------------------------------------------------------------
WARMUP_TIMEOUT = 0.1
WARMUP_RECOVERY = 0.2  # share of the warm-up's answer digits after a timeout that are right (the rest random)
CONFIG = ToolPPOConfig(n_groups=12, group_size=8, lr=1.5e-3, epochs=4, minibatches=1)


class TimeoutWorld(ToolWorld):
    """The tool world whose rare state is a timeout (the reply slots read ERR). `timeout_pay` scales the pay of an
    episode that timed out (1.0: paid as any other)."""

    def __init__(self, timeout_pay: float = 1.0) -> None:
        self.timeout_pay = timeout_pay

    @staticmethod
    def reply(digits: torch.Tensor, rare: torch.Tensor) -> torch.Tensor:
        return torch.where(rare[:, None], ERR, digits)

    def reward(self, ctx: torch.Tensor, info: dict) -> torch.Tensor:
        share = tools.right_share(ctx[:, 0], ctx[:, list(tools.ANSWER_SLOTS)])
        return torch.where(info["rare"], self.timeout_pay * share, share)


# --- The gymnasium environment: tokens in, tokens out. ----------------------------------------------------
class ToolRecoveryEnv(ToolEnv):
    """Call a tool, read its reply (or its timeout) as tokens, answer (`ToolEnv`): a timeout, with probability
    `timeout_prob`, writes ERR in the flag and the 3 reply slots. The reward, at the last step, is the share of
    answer digits equal to the tool's result for the query, times `timeout_pay` after a timeout.
    """

    def __init__(self, timeout_prob: float = TIMEOUT_BEFORE, timeout_pay: float = 1.0) -> None:
        super().__init__(TimeoutWorld(timeout_pay), timeout_prob)


ENV_ID = "stabench/ToolRecovery-v0"  # the id `ToolRecovery.environments` registers


# --- Warm start: copies usual replies, has no idea what to do after a timeout. ----------------------------
def _targets(queries: torch.Tensor, timeout: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """The warm-up's answers: right after a usual reply; after a timeout each digit right with probability
    WARMUP_RECOVERY and a uniform random digit otherwise."""
    noise = on_default_device(rng.integers(0, tools.N_DIGITS, (len(queries), 3)))
    practised = on_default_device(rng.random((len(queries), 3)) < WARMUP_RECOVERY)
    recovery = torch.where(practised, RESULTS[queries], noise)
    return torch.where(timeout[:, None], recovery, RESULTS[queries])


def _warm_up() -> nn.Module:
    """The policy after a short supervised warm-up in which WARMUP_TIMEOUT of the replies timed out, so the policy
    there leans a little towards the recovery but is far from it (`tools.warm_up`)."""
    return warm_up(TimeoutWorld(), WARMUP_TIMEOUT, _targets)


# shipped as tasks/warm_starts/tool-recovery.safetensors (after changing the warm-up: stabench warm-start --retrain)
warm_policy = WarmStart("tool-recovery", _warm_up, tools.context_policy,
                        sha256="a8a475a4728075e16a1687ae0d73c4936333ab740ec02b2413fcd4f692bc0359")

# --- Exact evaluation by enumeration: (expected share of right digits after a usual reply, after a timeout). --
exact_returns = tools.ExactReturns(TimeoutWorld())


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
class ToolRecoveryRun(DiagnosedRun):
    """One seed under one method: the trainer (policy, optimizer, numpy Generator) and the branch's schedule."""

    def __init__(
        self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...], knobs: Knobs
    ) -> None:
        self.budget, self.diagnostics, self.knobs = budget, diagnostics, knobs
        self.trainer = ToolPPO(warm_policy(), TimeoutWorld(), replace(CONFIG, seed=seed), stabilizer)
        self.evaluate = SameWeights()  # the exact returns, computed again only when the policy changed

    def train(self, injected: bool) -> tuple[dict[str, float], TrainState]:
        shifted = self.trainer.iteration >= self.budget.onset  # both branches: timeouts become common
        timeout_prob = float(self.knobs.timeout_after) if shifted else TIMEOUT_BEFORE
        self.trainer.world.timeout_pay = float(self.knobs.timeout_pay) if injected and shifted else 1.0
        state = self.trainer.iterate(timeout_prob)
        usual, timeout = self.evaluate(exact_returns, self.trainer.policy)
        batch, tool = state.batch, state.extras["tool_mask"]
        entropy = categorical_entropy(state.extras["logits"])  # after the update
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
        return row, state


def fig_recovery(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    panels = [
        ("return", "exact return"),
        ("return_tool", "return after a timeout"),
        ("entropy_tool", "tool-state entropy"),
    ]
    return fix_against_baseline(table, "tool-recovery", panels, out, name)


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
            "recovery",
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
