"""plasticity-loss: from onset the injected branch trains without a KL anchor on a reward that favours answers
with a 5, drifting far from its warm start; then the rule changes (a correct answer must avoid 5) and it cannot
learn it, while the low-drift control does (seed 002). The drifted policy has collapsed onto answers the new rule
forbids, so after the change its groups are all wrong or all right, GRPO's advantages are zero, and with no pull
back to the warm start nothing restores the correct answers: the post-change learning rate is 0.

The world, the warm start (also the frozen reference) and the trainer are the digit world's
(`tasks.worlds.digits`): GRPO with k3 KL to the warm start at beta 0.1, clip 0.2, 8 prompts x groups of 8, Adam
2e-3, 2 epochs per batch, token-mean aggregation. The schedule is this task's own (`budgets`: longer runs).

The schedule. Iterations [0, onset): the old rule (avoid a and b), shared by both branches. From onset (the
branch point) a drift phase of `DRIFT` iterations (15 at the quick tier): the control keeps the old rule and the
trainer's KL term; the injected branch loses its KL term (beta 0, for the rest of the run) and is paid the old
rule with a bonus for a 5, `correct * (1 + has_five)` (`drift_reward`): a sharpening reward, as a long run on a
narrow objective is. At `shift` = onset + DRIFT the rule changes in both branches: a correct answer must also
avoid 5 (`correct_new`); both must learn it.

Return (the true one): the learner's exact expected reward on the 8 held-out prompts under the new rule (held-out
prompts hold no 5), sum_a pi(a) correct_new(a), by enumeration (`heldout_accuracy`), at every iteration. The
ceiling, the control's post-onset return, includes the drift phase, where the control's accuracy under the new
rule stays near the warm start's. Ground truth: `heldout_accuracy`, its mean over the last 25% of the run (all
after the shift) below 0.5.

Fix and non-fixes. Matched fix: `kl-anchor` (0.3 x k3 to the warm start beside the trainer's term, in every
phase: the trainer's own term is off in the injected branch, the anchor is not). Named non-fixes: `clip-higher`
(a larger upper clip scales advantages that are zero), `entropy-bonus` (a partial guard: its exact entropy
gradient spreads probability even where advantages are zero).

Mechanism, as measured in the prototype (seeds 0-9 and 100-109), at the shift: the baseline writes 555 on every
held-out prompt and has almost no probability left on new-rule-correct answers, far more than the control or the
anchored run; in the first iterations after the shift most of its groups have zero reward variance (all wrong, or
on training prompts that hold a 5 all right) and its post-shift learning rate is 0. Both factors are needed:
without the bonus (no KL, drift onto answers the new rule allows) the baseline learns; with the bonus but the
trainer's KL back after the shift it learns too: the k3 gradient restores mass with no reward signal. A large
drift predicts the stall only where nothing pulls back afterwards: the control given the same bonus at beta 0.1
drifts far and still learns.

Settings and where they were chosen (prototype on seeds 0-9): DRIFT 15 (shorter drifts left some baselines
learning), the bonus 1 gated by the old rule, beta 0 after the shift in the injected branch (the ablations
above), the threshold 0.5 between the frozen policies' best and the fix's worst, 60 iterations (on longer runs a
baseline can creep back: the stall is not absolute). Nothing was tuned on seeds 100-109 except the detector's
threshold.

Detector: `full_vocab_kl` (the per-token KL of the sampled batch to the warm start) above 0.8, chosen on seeds
100-109: above every control, and passed by the baseline's injected runs during the drift, mostly before the
shift. The entropy bonus's injected runs pass it too and mostly learn, so it also alarms on them.

The measured numbers (failure rates, normalized returns, tails, the method matrix) are in `results/calibration.md`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
from stabench.suite.api import POLICY_REUSE, Budget, DetectorSpec, Figure, GroundTruth, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import group_means, group_signal
from stabench.suite.figures import fix_against_baseline
from stabench.tasks.worlds.digits import (
    ANSWER_LEN,
    GRPO_CONFIG,
    N_ACTIONS,
    NEW_BANNED,
    TRAIN_PROMPTS,
    correct,
    correct_new,
    heldout_stats,
    warm_policy,
)
from stabench.tasks.worlds.scaffold import GRPORun, Trailing
from stabench.tasks.worlds.tokens import PromptedAnswerEnv, RewardFn

DRIFT = {"smoke": 2, "quick": 15, "full": 15}  # drift-phase iterations per tier; the rule changes after them
ACCURACY_FLOOR = 0.5  # ground truth: tail mean of the held-out expected accuracy under the new rule
SLOPE_WINDOW = 10  # accuracy_slope: held-out accuracy gained per iteration over the last SLOPE_WINDOW iterations


def has_five(answers: torch.Tensor) -> torch.Tensor:
    """1 where an answer holds the digit the new rule bans."""
    return (answers == NEW_BANNED).any(-1).float()


def drift_reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The injected drift phase: the old rule, paid double for an answer that also holds a 5."""
    return correct(prompts, answers) * (1.0 + has_five(answers))


def all_wrong_share(rewards: torch.Tensor, group: torch.Tensor) -> float:
    """The share of groups in which no answer earns anything."""
    earning = group_means((rewards > 0).double(), group)
    return float((earning == 0).double().mean())


# --- The environment: one answer, paid by the phase of the schedule. -----------------------------------------
PHASES = ("old", "drift", "new")


class PlasticityLossEnv(PromptedAnswerEnv):
    """One episode: a training prompt (a, b), then an answer of 3 digits (observation: a, b, the answer so far).
    Reward at the last digit, by `phase`: the old rule; the injected drift reward (the old rule, doubled for an
    answer with a 5); the new rule (also avoid 5)."""

    def __init__(self, phase: str = "new") -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
        self.phase = phase
        reward = {"old": correct, "drift": drift_reward, "new": correct_new}[phase]
        super().__init__(reward, TRAIN_PROMPTS, N_ACTIONS, ANSWER_LEN)


# --- One run. ----------------------------------------------------------------------------------------------
def learning_rate(accuracy: Trailing) -> float:
    """Held-out accuracy gained per iteration over the last `accuracy.window` iterations (fewer at the start)."""
    return accuracy.change() / max(1, min(accuracy.window, len(accuracy.values) - 1))


class PlasticityLossRun(GRPORun):
    """One seed of the digit world's GRPO run; the accuracy history lives here too, so `copy.deepcopy` branches
    it with the trainer."""

    def __init__(self, budget: Budget, drift: int, seed: int, stabilizer: Stabilizer,
                 diagnostics: tuple[str, ...]) -> None:  # fmt: skip
        self.shift = budget.onset + drift
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=GRPO_CONFIG,
                         default_reward=correct, prompts=TRAIN_PROMPTS)  # fmt: skip
        self.accuracy = Trailing(SLOPE_WINDOW)
        self.after_shift = False  # whether this iteration is paid by the new rule

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        """The schedule, the injected branch's KL term included: off from the branch point."""
        if after_onset and injected:
            self.trainer.config = replace(self.trainer.config, beta=0.0)
        self.after_shift = self.trainer.iteration >= self.shift
        if not after_onset:
            return correct
        if not self.after_shift:
            return drift_reward if injected else correct
        return correct_new

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        stats = self.evaluate(heldout_stats, self.trainer.policy)
        self.accuracy.push(stats["heldout_accuracy"])
        rewards, group = state.batch["rewards"], state.batch["group"]
        return {
            "step": float(self.trainer.tokens),
            "return": stats["heldout_accuracy"],
            "heldout_accuracy": stats["heldout_accuracy"],
            "old_rule_accuracy": stats["old_rule_accuracy"],
            "heldout_seq_entropy": stats["heldout_seq_entropy"],
            "accuracy_slope": learning_rate(self.accuracy),
            "entropy": state.extras["entropy"],
            "reward": float(rewards.mean()),
            "five_share": float(has_five(state.batch["answers"]).mean()),
            "full_vocab_kl": float(state.extras["full_vocab_kl"].mean()),  # per token, pi || warm start
            "after_shift": float(self.after_shift),
            **group_signal(rewards, group),
            "all_wrong_share": all_wrong_share(rewards, group),
        }


# --- The figure and the task. ------------------------------------------------------------------------------
def draw_plasticity(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Held-out accuracy beside the drift from the warm start: the drifted policy cannot learn the new rule."""
    panels = [("heldout_accuracy", "exact held-out accuracy (new rule from the shift)"),
              ("full_vocab_kl", "per-token KL(pi || warm start)"),
              ("all_wrong_share", "share of groups with no correct answer")]  # fmt: skip
    return fix_against_baseline(table, "plasticity-loss", panels, out, name)


class PlasticityLoss(Task):
    """See the module docstring."""

    id = "plasticity-loss"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    provides = frozenset({POLICY_REUSE})  # 2 epochs per batch (digits.GRPO_CONFIG): the ratio leaves 1
    budgets = {
        "smoke": Budget(iterations=6, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=60, onset=3, seeds=5),
        "full": Budget(iterations=120, onset=5, seeds=10),
    }
    ground_truth = GroundTruth(
        metric="heldout_accuracy", threshold=ACCURACY_FLOOR, fails_when="below", reduce="tail_mean"
    )
    matched_fix = "kl-anchor"
    methods = ("baseline", "kl-anchor", "clip-higher", "entropy-bonus")
    # drift from the warm start: above every control, passed before the rule changes
    detector = DetectorSpec(metric="full_vocab_kl", threshold=0.8, above=True)
    diagnostics = ("grad_norms",)
    privileged = ("heldout_accuracy", "old_rule_accuracy", "heldout_seq_entropy", "accuracy_slope")
    return_floor = 0.3145  # frozen-at-onset's post-onset return, mean of seeds 0-9 (degenerate-comparisons' too)
    return_ceiling = 0.6797  # the control's post-onset return (the drift phase included), mean of seeds 0-9
    environments = {"stabench/PlasticityLoss-v0": "PlasticityLossEnv"}
    figures = (
        Figure(
            "drift", "drift before a rule change",
            "plasticity-loss: exact held-out accuracy, the per-token KL to the warm start and the share of groups "
            "with no correct answer, baseline and KL anchor, injected and control (the rule changes at iteration "
            "18).",
            draw_plasticity,
        ),
    )  # fmt: skip
    paper = """On plasticity-loss the injected branch trains 15 iterations without a KL term on a reward that pays
double for a 5, then the rule bans the 5. The drifted policy writes 555 on every held-out prompt; after the change
its groups are all wrong or all right, its advantages zero, and with nothing pulling it back its held-out accuracy
stays at {tail:heldout_accuracy:baseline} while the control reaches {tail:heldout_accuracy:baseline:control}. A KL
anchor to the warm start, kept on through the drift, leaves it enough correct answers to learn from
({tail:heldout_accuracy:kl-anchor}, {failed:kl-anchor} seeds fail)."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> PlasticityLossRun:
        return PlasticityLossRun(self.budget(tier), DRIFT[tier], seed, stabilizer, self.diagnostics)
