"""degenerate-comparisons: after onset 7 of GRPO's 8 groups are solved or unsolvable problems (all correct or
all wrong: zero reward variance) while a new rule must be learned from the one group that compares (seed 002).
The silent groups add nothing to the policy term but keep their share of the KL term, so the pull back to the
warm start outweighs the live group's signal and the rule is learned only in part.

The world, the warm start (also the frozen reference), the trainer and the schedule are the digit world's
(`tasks.worlds.digits`): GRPO with k3 KL to the warm start at beta 0.1, clip 0.2, 8 prompts x groups of 8, Adam
2e-3, 2 epochs per batch, token-mean aggregation. Before onset a correct answer avoids a and b; from onset it must
also avoid 5 (`correct_new`), which the warm start writes often: both branches must learn it.

The injection. From onset the injected branch's batches hold `N_LIVE` = 1 group graded by the new rule and 7
degenerate groups: 4 of problems the policy always solves and 3 it never solves. Their grade does not depend on
the answer (modelled as a constant 1 or 0 per group: a solved or an unsolvable problem), so their reward variance
is 0 and so is every advantage in them. The control's 8 groups are all graded by the new rule.

Return (the true one): the learner's exact expected reward on the 8 held-out prompts under the new rule,
sum_a pi(a) correct_new(a), by enumeration (`heldout_accuracy`). Ground truth: `heldout_accuracy`, its mean over
the last 25% of the run below 0.7.

Fix and non-fixes. Matched fix: `variance-filter` (DAPO's dynamic-sampling filter without the resampling):
zero-variance groups leave every term of the loss, the others keep the trainer's total weight. Named non-fixes:
an entropy bonus (`entropy-bonus`, a third undiluted term), clip-higher. Not run: "a larger batch at the same
compute" (a batch size is the task's trainer setting, not a stabilizer hook).

Mechanism: not a lack of gradient but a regularizer that outweighs it. A degenerate group adds nothing to the
policy term but its tokens still carry the KL term, on prompts like the live ones; with 7 of 8 groups silent, the
token-mean policy term is 1/8 of the control's while the KL term is whole, so the pull back to the warm start wins
(as if beta were 8 times larger) and the policy learns a fraction of the rule, staying near the warm start. At
beta 0 the same injection barely hurts (prototype, seeds 0-3): Adam rescales a policy term that is only smaller.
Removing the degenerate groups from every term restores the control's ratio, and one live group per batch then
suffices to learn the rule. For the same reason a weaker anchor helps and a stronger one (`kl-anchor`) hurts.

Settings and where they were chosen (prototype on seeds 0-3, then seeds 0-9): 1 live group of 8 (2 live groups
left the baseline too near the fix), beta 0.1 (the digit world's; 0.2 slowed the control and the fix), the
threshold 0.7 between the baseline's and the fix's tails on seeds 0-9. Nothing was tuned on seeds 100-109 except
the detector's threshold.

Detector: `zero_variance_recent` (the zero-variance share averaged over the last `RECENT` = 10 iterations) above
0.85, chosen on seeds 100-109. It reads the injection itself (7 of 8 groups silent from onset), so it also alarms
on the fix's injected runs, which stay healthy; one iteration's share is too noisy to use (a learning control has
batches where every group is solved).

The measured numbers (failure rates, normalized returns, tails, the method matrix) are in `results/calibration.md`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from stabench.suite.api import (
    POLICY_REUSE,
    Budget,
    DetectorSpec,
    Figure,
    GroundTruth,
    StabenchError,
    Stabilizer,
    Task,
    TrainState,
)
from stabench.suite.diagnostics import group_signal
from stabench.suite.figures import fix_against_baseline
from stabench.tasks.worlds.digits import (
    ANSWER_LEN,
    BUDGETS,
    GRPO_CONFIG,
    N_ACTIONS,
    TRAIN_PROMPTS,
    correct,
    correct_new,
    heldout_accuracy,
    warm_policy,
)
from stabench.tasks.worlds.scaffold import GRPORun, Trailing
from stabench.tasks.worlds.tokens import PromptedAnswerEnv, RewardFn

N_LIVE = 1  # groups per injected batch graded by the new rule; the rest are degenerate
ACCURACY_FLOOR = 0.7  # ground truth: tail mean of the held-out expected accuracy
GRADES = ("live", "solved", "unsolvable")
RECENT = 10  # zero_variance_recent: the mean zero-variance share over the last RECENT iterations


def degenerate_grades(n_groups: int, n_live: int = N_LIVE) -> list[str]:
    """The grade of each group of an injected batch: `n_live` live groups, then solved and unsolvable ones
    (solved first, one more of them when the count is odd)."""
    rest = n_groups - n_live
    return ["live"] * n_live + ["solved"] * ((rest + 1) // 2) + ["unsolvable"] * (rest // 2)


def graded_reward(grades: list[str], group_size: int) -> RewardFn:
    """A reward function paying `correct_new` on live groups, 1 on solved and 0 on unsolvable ones (group
    members adjacent, in the order of `grades`)."""

    def reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        paid = correct_new(prompts, answers).view(len(grades), group_size).clone()
        for g, grade in enumerate(grades):
            if grade != "live":
                paid[g] = float(grade == "solved")
        return paid.view(-1)

    return reward


# --- The environment: one answer to a problem of a given grade. --------------------------------------------
class DegenerateComparisonsEnv(PromptedAnswerEnv):
    """One episode: a training prompt (a, b), then an answer of ANSWER_LEN digits (observation: a, b, the answer
    so far). Reward at the last digit: `correct` before onset; after onset `correct_new` on a live problem, 1 on
    a solved one and 0 on an unsolvable one (`grade`), whatever the answer."""

    def __init__(self, after_onset: bool = True, grade: str = "live") -> None:
        if grade not in GRADES:
            raise ValueError(f"grade must be one of {', '.join(GRADES)}, got {grade!r}")
        self.grade = grade
        reward = correct_new if grade == "live" else graded_reward([grade], 1)
        super().__init__(reward if after_onset else correct, TRAIN_PROMPTS, N_ACTIONS, ANSWER_LEN)


# --- Knobs. ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """`DegenerateComparisons(**knobs)`; the defaults are the calibrated task."""

    n_live: int = N_LIVE  # live groups per injected batch (of GRPO_CONFIG.n_groups)

    def check(self, shortest_run: int) -> None:
        ok = isinstance(self.n_live, (int, np.integer)) and not isinstance(self.n_live, bool)
        if not (ok and 1 <= self.n_live <= GRPO_CONFIG.n_groups):
            raise StabenchError(
                f"degenerate-comparisons: n_live must be an integer in 1..{GRPO_CONFIG.n_groups}, got {self.n_live!r}"
            )


# --- One run. ----------------------------------------------------------------------------------------------
class DegenerateComparisonsRun(GRPORun):
    """One seed of the digit world's GRPO run; the zero-variance history lives here too, so `copy.deepcopy`
    branches it with the trainer."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 n_live: int) -> None:  # fmt: skip
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=GRPO_CONFIG,
                         default_reward=correct, prompts=TRAIN_PROMPTS)  # fmt: skip
        cfg = self.trainer.config
        self.injected_reward = graded_reward(degenerate_grades(cfg.n_groups, n_live), cfg.group_size)
        self.silent = Trailing(RECENT)  # zero_variance_share per iteration

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        return (self.injected_reward if injected else correct_new) if after_onset else correct

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        signal = group_signal(state.batch["rewards"], state.batch["group"])
        self.silent.push(signal["zero_variance_share"])
        accuracy = self.evaluate(heldout_accuracy, self.trainer.policy)
        return {
            "step": float(self.trainer.tokens),
            "return": accuracy,
            "heldout_accuracy": accuracy,
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            "full_vocab_kl": float(state.extras["full_vocab_kl"].mean()),  # per token, pi || warm start
            **signal,
            "zero_variance_recent": self.silent.mean(),
        }


# --- The figure and the task. ------------------------------------------------------------------------------
def draw_degenerate(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Held-out accuracy beside the policy's KL to the warm start: the silent groups leave the KL in charge."""
    panels = [("heldout_accuracy", "exact held-out accuracy (new rule)"),
              ("full_vocab_kl", "per-token KL(pi || warm start)")]  # fmt: skip
    return fix_against_baseline(table, "degenerate-comparisons", panels, out, name)


class DegenerateComparisons(Task):
    """See the module docstring."""

    id = "degenerate-comparisons"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    provides = frozenset({POLICY_REUSE})  # 2 epochs per batch (digits.GRPO_CONFIG): the ratio leaves 1
    budgets = BUDGETS
    ground_truth = GroundTruth(
        metric="heldout_accuracy", threshold=ACCURACY_FLOOR, fails_when="below", reduce="tail_mean"
    )
    matched_fix = "variance-filter"
    methods = ("baseline", "variance-filter", "entropy-bonus", "clip-higher")
    # most groups silent for 10 iterations (one iteration is too noisy: a learning control has all-correct
    # batches at times)
    detector = DetectorSpec(metric="zero_variance_recent", threshold=0.85, above=True)
    diagnostics = ("grad_norms",)  # group_signal is computed in the run: zero_variance_recent reads its history
    privileged = ("heldout_accuracy",)
    return_floor = 0.3145  # frozen-at-onset's post-onset return, mean of seeds 0-9 (exact per seed)
    return_ceiling = 0.7972  # the control's post-onset return, mean of seeds 0-9
    knobs_type = Knobs
    environments = {"stabench/DegenerateComparisons-v0": "DegenerateComparisonsEnv"}
    figures = (
        Figure(
            "silent-groups", "silent groups and the KL pull",
            "degenerate-comparisons: exact held-out accuracy (left) and the policy's KL to the warm start (right), "
            "baseline and variance filter, injected and control.",
            draw_degenerate,
        ),
    )  # fmt: skip
    paper = """On degenerate-comparisons seven of the eight groups of each injected batch are problems the policy
always solves or never solves, so their rewards do not vary, while a new rule must be learned from the one group
that compares. The silent groups starve nothing by themselves (with no KL term the same injection barely hurts);
they keep their share of the KL term while adding nothing to the policy term, so the pull back to the warm start
wins, and dropping them from every term (the variance filter) restores learning from the one group that
compares."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> DegenerateComparisonsRun:
        return DegenerateComparisonsRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.n_live)
