"""hard-sample-shortcuts: after onset 6 of GRPO's 8 groups are nearly impossible problems whose rare successes
are lucky shortcut answers (an answer that copies a digit of the question), while a new rule must be learned
from the other 2 (seed 002). The lucky successes teach the shortcut, which breaks the rule on every problem, and
the silent impossible groups also dilute the rule's signal; dropping the groups whose success rate is near zero
removes both.

The world, the warm start (also the frozen reference), the trainer and the schedule are the digit world's
(`tasks.worlds.digits`): GRPO with k3 KL to the warm start at beta 0.1, clip 0.2, 8 prompts x groups of 8, Adam
2e-3, 2 epochs per batch, token-mean aggregation. Before onset a correct answer avoids a and b (the old rule,
which the warm start follows but not always: some of its answers copy a prompt digit); from onset it must also
avoid 5 (`correct_new`), which the warm start writes often: both branches must learn it.

The injection. From onset the injected branch's batches hold `N_LIVE` = 2 groups graded by the new rule and 6
groups of nearly impossible problems (`hard_reward`): no answer solves them by the rule, but an answer that
copies a prompt digit (the shortcut, `copies_prompt`: wrong under both rules) is accepted with probability
`LUCK` = 0.2, as a guess taken from the question sometimes is, so those groups succeed on a few percent of their
answers. The luck draws come from a Generator of their own, drawn every iteration. The control's 8 groups are
all graded by the new rule: the same number of problems, none of them impossible; it is, draw for draw,
degenerate-comparisons' control.

Return (the true one): the learner's exact expected reward on the 8 held-out prompts under the new rule,
sum_a pi(a) correct_new(a), by enumeration (`heldout_accuracy`). The shortcut's own rate on those prompts is
`shortcut_rate` = 1 - `old_rule_accuracy` (the accuracy on the pre-onset problems). Floor and ceiling are
degenerate-comparisons' (the same frozen policies, the same control branch). Ground truth: `heldout_accuracy`,
its mean over the last 25% of the run below 0.7.

Fix and non-fixes. Matched fix: `difficulty-filter`, which drops every group whose success rate is at most 1/8
(and, as the variance filter, every group whose rewards are all equal) from every term of the loss. Named
non-fixes: `advantage-clip` (every advantage clipped to [-1, 1]: a lucky success weighs at most 1 instead of
2.47), `variance-filter` (drops the all-wrong groups, keeps those with one lucky success), `dr-grpo` (no std
division: the same push, unscaled).

Mechanism: two parts, told apart by the variance filter.
- The lucky successes teach the shortcut: the baseline relearns the habit of copying a prompt digit that the
  control unlearns, and the lucky groups carry a large share of the batch's positive advantage
  (`rare_push_share`).
- The silent impossible groups dilute the policy term against the KL term (degenerate-comparisons' mechanism):
  the baseline stays nearer the warm start than the control.
The variance filter removes the second part only; the difficulty filter removes both. Neither group
normalization (`dr-grpo`) nor the size of the lucky advantage (`advantage-clip`) is what drives it.

Settings and where they were chosen (prototype on seeds 0-3, then the task on seeds 0-9): 2 live groups of 8 (3
left the baseline near the control), the shortcut "copies a prompt digit" (copying the whole question, aaa or an
answer of a and b only, is too rare under the warm start to be found in 50 iterations), luck 0.2 (at 0.3 the
difficulty filter's kept groups of 2 lucky successes still taught the shortcut; at 0.5 and 1.0 the impossible
groups were no longer near zero and the filter kept them), beta 0.1 (the world's; at beta 0 the 1-live-group
variant was too noisy). Nothing was tuned on seeds 100-109 except the detector's threshold.

Detector: `rare_push_recent` (the lucky groups' share of the positive advantage, averaged over the last
`RECENT` = 10 iterations) above 0.2, chosen on seeds 100-109. It reads the lucky groups, which the injection
brings from onset, so it also alarms on the fix's injected runs (the filter drops those groups from the loss, not
from the diagnostic).

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
from stabench.suite.diagnostics import group_signal, rare_successes
from stabench.suite.figures import need, side_by_side
from stabench.tasks.worlds.digits import (
    ANSWER_LEN,
    BUDGETS,
    GRPO_CONFIG,
    N_ACTIONS,
    TRAIN_PROMPTS,
    correct,
    correct_new,
    heldout_stats,
    warm_policy,
)
from stabench.tasks.worlds.scaffold import GRPORun, Trailing
from stabench.tasks.worlds.tokens import PromptedAnswerEnv, RewardFn

N_LIVE = 2  # groups per injected batch graded by the new rule; the rest are nearly impossible
LUCK = 0.2  # the chance that an impossible problem accepts a shortcut answer
ACCURACY_FLOOR = 0.7  # ground truth: tail mean of the held-out expected accuracy
GRADES = ("live", "hard")
RECENT = 10  # rare_push_recent: the mean rare_push_share over the last RECENT iterations


def copies_prompt(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """1 where an answer writes a digit of its prompt (the shortcut; wrong under both rules): 1 - `correct`."""
    return 1.0 - correct(prompts, answers)


def hard_reward(prompts: torch.Tensor, answers: torch.Tensor, draws: np.ndarray, luck: float = LUCK) -> torch.Tensor:
    """A nearly impossible problem: a shortcut answer is accepted when its uniform draw (`draws` [B]) is below
    `luck`, any other answer never."""
    return copies_prompt(prompts, answers) * torch.as_tensor(draws < luck, dtype=torch.float32)


def graded_reward(n_live: int, group_size: int, draws: np.ndarray, luck: float = LUCK) -> RewardFn:
    """The injected reward: `correct_new` on the first `n_live` groups (members adjacent), `hard_reward` on the
    rest, with the batch's uniform draws `draws` [B]."""

    def reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        split = n_live * group_size
        hard = hard_reward(prompts[split:], answers[split:], draws[split:], luck)
        return torch.cat([correct_new(prompts[:split], answers[:split]), hard])

    return reward


def shortcut_stats(model: torch.nn.Module) -> dict[str, float]:
    """Exact on the held-out prompts (`heldout_stats`): the new rule's accuracy, the old rule's (the pre-onset
    problems) and the shortcut's rate (1 - the old rule's accuracy)."""
    stats = heldout_stats(model)
    old = stats["old_rule_accuracy"]
    return {"heldout_accuracy": stats["heldout_accuracy"], "old_rule_accuracy": old, "shortcut_rate": 1.0 - old}


# --- The environment: one answer to a live or a nearly impossible problem. ---------------------------------
class HardSampleShortcutsEnv(PromptedAnswerEnv):
    """One episode: a training prompt (a, b), then an answer of ANSWER_LEN digits (observation: a, b, the answer
    so far). Reward at the last digit: `correct` before onset; after onset `correct_new` on a live problem, and
    on a hard one 1 with probability LUCK if the answer copies a prompt digit, else 0 (`grade`)."""

    def __init__(self, after_onset: bool = True, grade: str = "live") -> None:
        if grade not in GRADES:
            raise ValueError(f"grade must be one of {', '.join(GRADES)}, got {grade!r}")
        self.grade = grade
        reward = (correct_new if grade == "live" else self._hard) if after_onset else correct
        super().__init__(reward, TRAIN_PROMPTS, N_ACTIONS, ANSWER_LEN)

    def _hard(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        return hard_reward(prompts, answers, self.np_random.random(len(answers)))


# --- Knobs. ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """`HardSampleShortcuts(**knobs)`; the defaults are the calibrated task."""

    n_live: int = N_LIVE  # live groups per injected batch (of GRPO_CONFIG.n_groups)
    luck: float = LUCK  # the chance that an impossible problem accepts a shortcut answer

    def check(self, shortest_run: int) -> None:
        if not (isinstance(self.luck, (int, float)) and not isinstance(self.luck, bool) and 0 < self.luck <= 1):
            raise StabenchError(f"hard-sample-shortcuts: luck must be a number in (0, 1], got {self.luck!r}")
        ok = isinstance(self.n_live, (int, np.integer)) and not isinstance(self.n_live, bool)
        if not (ok and 1 <= self.n_live <= GRPO_CONFIG.n_groups):
            raise StabenchError(
                f"hard-sample-shortcuts: n_live must be an integer in 1..{GRPO_CONFIG.n_groups}, got {self.n_live!r}"
            )


# --- One run. ----------------------------------------------------------------------------------------------
class HardSampleShortcutsRun(GRPORun):
    """One seed of the digit world's GRPO run (degenerate-comparisons' prompt stream); the luck Generator and the
    push history live here too, so `copy.deepcopy` branches them with the trainer."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 knobs: Knobs) -> None:  # fmt: skip
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=GRPO_CONFIG,
                         default_reward=correct, prompts=TRAIN_PROMPTS)  # fmt: skip
        self.knobs = knobs
        self.luck_rng = np.random.default_rng([seed, 2])
        self.pushes = Trailing(RECENT)  # rare_push_share per iteration

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        cfg = self.trainer.config
        draws = self.luck_rng.random(cfg.n_groups * cfg.group_size)  # every iteration, so the stream never shifts
        if not after_onset:
            return correct
        return graded_reward(self.knobs.n_live, cfg.group_size, draws, self.knobs.luck) if injected else correct_new

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        rewards, group = state.batch["rewards"], state.batch["group"]
        rare = rare_successes(rewards, group, state.extras["advantages"][:, 0])
        self.pushes.push(rare["rare_push_share"])
        stats = self.evaluate(shortcut_stats, self.trainer.policy)
        return {
            "step": float(self.trainer.tokens),
            "return": stats["heldout_accuracy"],
            **stats,
            "entropy": state.extras["entropy"],
            "reward": float(rewards.mean()),
            "batch_shortcut": float(copies_prompt(state.batch["prompts"], state.batch["answers"]).mean()),
            "full_vocab_kl": float(state.extras["full_vocab_kl"].mean()),  # per token, pi || warm start
            **group_signal(rewards, group),
            **rare,
            "rare_push_recent": self.pushes.mean(),
        }


# --- The figure and the task. ------------------------------------------------------------------------------
def draw_shortcuts(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Held-out accuracy beside the shortcut's rate: lucky successes on impossible problems teach the shortcut."""
    rows = need(table, "hard-sample-shortcuts", "heldout_accuracy", "shortcut_rate")
    rows = rows[(rows["role"].isin(["baseline", "matched-fix"]) | (rows["method"] == "variance-filter"))]
    rows = rows[(rows["variant"] == "injected") | (rows["method"] == "baseline")]
    rows = rows.assign(run=rows["method"] + " (" + rows["variant"] + ")")
    panels = [("heldout_accuracy", "exact held-out accuracy (new rule)"),
              ("shortcut_rate", "share of answers copying a prompt digit")]  # fmt: skip
    return side_by_side(rows, panels, "run", "hard-sample-shortcuts", out, name)


class HardSampleShortcuts(Task):
    """See the module docstring."""

    id = "hard-sample-shortcuts"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    provides = frozenset({POLICY_REUSE})  # 2 epochs per batch (digits.GRPO_CONFIG): the ratio leaves 1
    budgets = BUDGETS
    ground_truth = GroundTruth(
        metric="heldout_accuracy", threshold=ACCURACY_FLOOR, fails_when="below", reduce="tail_mean"
    )
    matched_fix = "difficulty-filter"
    methods = ("baseline", "difficulty-filter", "advantage-clip", "variance-filter", "dr-grpo")
    # the lucky groups' share of the push over 10 iterations (one iteration is noisy)
    detector = DetectorSpec(metric="rare_push_recent", threshold=0.2, above=True)
    diagnostics = ("grad_norms",)  # group_signal and rare_successes are computed in the run
    privileged = ("heldout_accuracy", "old_rule_accuracy", "shortcut_rate")
    return_floor = 0.3145  # degenerate-comparisons' (the same frozen policies): mean of seeds 0-9
    return_ceiling = 0.7972  # degenerate-comparisons' (the same control branch): mean of seeds 0-9
    knobs_type = Knobs
    environments = {"stabench/HardSampleShortcuts-v0": "HardSampleShortcutsEnv"}
    figures = (
        Figure(
            "shortcuts", "lucky shortcuts on impossible problems",
            "hard-sample-shortcuts: exact held-out accuracy (left) and the share of answers copying a prompt digit "
            "(right), baseline (injected and control), variance filter and difficulty filter (injected).",
            draw_shortcuts,
        ),
    )  # fmt: skip
    paper = """On hard-sample-shortcuts six of the eight groups of each injected batch are nearly impossible
problems whose only successes are lucky answers that copy a digit of the question, while a new rule must be
learned from the other two; the baseline relearns that habit ({tail_percent:shortcut_rate:baseline} of its
held-out answers copy a prompt digit in the tail, the control's {tail_percent:shortcut_rate:baseline:control}) and
fails {failed:baseline} seeds. The variance filter, which drops the all-wrong groups but keeps those with one lucky
success, fixes only the dilution part and fails {failed:variance-filter} seeds; dropping every group whose success
rate is at most 1/8 (the difficulty filter) removes the lucky push and fails {failed:difficulty-filter}. Neither
the std division nor the size of the lucky advantage drives it: the baseline without the division (Dr. GRPO) fails
{failed:dr-grpo} seeds, and with advantages clipped to 1, {failed:advantage-clip}."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> HardSampleShortcutsRun:
        return HardSampleShortcutsRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs)
