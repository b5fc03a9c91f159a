"""hard-sample-shortcuts: after onset 6 of GRPO's 8 groups are nearly impossible problems whose rare successes
are lucky shortcut answers (an answer that copies a digit of the question), while a new rule must be learned
from the other 2 (seed 002). Measured: the lucky successes teach the shortcut, which breaks the rule on every
problem, and the silent impossible groups also dilute the rule's signal; dropping the groups whose success rate
is near zero removes both.

The world is entropy-collapse's (`tasks.entropy_collapse`): a prompt is two digits (a, b) from 0-5, an answer
3 digits (216 answers, all enumerable), the policy the same tiny GPT-2 warm start and the same GRPO (k3 KL to
the warm start at beta 0.1, clip 0.2, 8 prompts x groups of 8, Adam 2e-3, 2 epochs per batch, token-mean
aggregation). Before onset a correct answer avoids a and b (the old rule, which the warm start follows but not
always: on the held-out prompts 26% of its answers copy a prompt digit); from onset it must also avoid 5
(`correct_new`), which the warm start writes often (held-out accuracy about 0.33): both branches must learn it.

The injection. From onset the injected branch's batches hold `N_LIVE` = 2 groups graded by the new rule and 6
groups of nearly impossible problems (`hard_reward`): no answer solves them by the rule, but an answer that
copies a prompt digit (the shortcut, `copies_prompt`: wrong under both rules) is accepted with probability
`LUCK` = 0.2, as a guess taken from the question sometimes is. At onset about 15% of the sampled answers copy
a prompt digit, so those groups succeed on about 3% of their answers. The control's 8 groups are all graded by
the new rule: the same number of problems, none of them impossible.

Return (the true one): the learner's exact expected reward on the 8 held-out prompts under the new rule,
sum_a pi(a) correct_new(a), by enumeration (`heldout_accuracy`). The shortcut's own rate on those prompts is
`shortcut_rate` = 1 - `old_rule_accuracy` (the accuracy on the pre-onset problems).
- `return_floor`: the policy frozen at onset (`frozen-at-onset`), its post-onset return, mean of seeds 0-9.
- `return_ceiling`: the control's (baseline method, control branch) post-onset return, mean of seeds 0-9.
The control branch is, draw for draw, degenerate-comparisons' control, so both numbers are that task's.
Ground truth: `heldout_accuracy`, its mean over the last 25% of the run below 0.7 (the frozen policies hold
0.20-0.39; the control ends at 0.78-0.92 on seeds 0-9).

Fix and non-fixes. Matched fix: `difficulty-filter`, which drops every group whose success rate is at most 1/8
(and, as the variance filter, every group whose rewards are all equal) from every term of the loss. Named
non-fixes: `advantage-clip` (every advantage clipped to [-1, 1]: a lucky success weighs at most 1 instead of
2.47), `variance-filter` (drops the all-wrong groups, keeps those with one lucky success), `dr-grpo` (no std
division: the same push, unscaled).

Mechanism, as measured: two parts, told apart by the variance filter.
- The lucky successes teach the shortcut. In the tail the baseline copies a prompt digit in 30% of its held-out
  answers (the control 10%, the warm start 26%: the control unlearns the habit, the baseline relearns it), and
  the lucky groups carry 31% of the batch's positive advantage (`rare_push_share`).
- The silent impossible groups dilute the policy term against the KL term (degenerate-comparisons' mechanism):
  the baseline's per-token KL to the warm start is 0.20 against the control's 0.41.
The variance filter removes the second part only: it restores the KL (0.29-0.71) and fails 4/10, with the
shortcut still at 0.18-0.36. The difficulty filter removes both (shortcut 0.06-0.28). Group normalization is
not what drives it: without the std division (`dr-grpo`) the baseline fails as much (10/10, 0.37); nor is the
size of the lucky advantage: clipped to 1 (`advantage-clip`) it fails 10/10 (0.50).

Settings and where they were chosen (prototype on seeds 0-3, then the task on seeds 0-9): 2 live groups of 8
(3 left the baseline at 0.56-0.67, near the control), the shortcut "copies a prompt digit" (copying the whole
question, aaa or an answer of a and b only, has a warm-start rate of 0.04% and 0.2%: too rare to be found in
50 iterations), luck 0.2 (at 0.3 the difficulty filter failed 3/10, its kept groups of 2 lucky successes still
teaching the shortcut; at 0.5 and 1.0 the impossible groups were no longer near zero and the filter kept
them), beta 0.1 (the world's; at beta 0 the 1-live-group variant was too noisy: control 0.61-0.92, baseline
0.37-0.77). Nothing was tuned on seeds 100-109 except the detector's threshold.

Numbers (quick tier: onset 3, 50 iterations; 10 seeds; normalized return with its 95% bootstrap interval;
tail = the held-out accuracy over the last 25% of the run):
  seeds 0-9                  failed  control failed  normalized return    tail accuracy (per seed)
    baseline                 10/10   0/10            0.49 [0.42, 0.55]    0.48-0.66 (control 0.78-0.92)
    difficulty-filter (fix)   1/10   0/10            0.83 [0.75, 0.91]    0.69-0.91
    variance-filter           4/10   0/10            0.67 [0.60, 0.75]    0.58-0.79
    advantage-clip           10/10   0/10            0.50 [0.44, 0.55]    0.51-0.69
    dr-grpo                  10/10   0/10            0.37 [0.33, 0.40]    0.43-0.56
    frozen-at-onset          10/10   10/10           0.00                 0.20-0.39
    no-update                10/10   10/10           0.02                 0.33
  seeds 100-109 (fresh)
    baseline                 10/10   0/10            0.45 [0.38, 0.52]    0.45-0.64
    difficulty-filter (fix)   1/10   0/10            0.82 [0.74, 0.90]    0.67-0.86
    variance-filter           6/10   0/10            0.66                 0.55-0.82
    advantage-clip, dr-grpo  10/10   0/10            0.50, 0.39
    references               10/10   10/10           at most 0.03
A quick-tier trial (healthy phase and both branches) takes 4.3 s (median) on a core shared with another job.
Detector: `rare_push_recent` (the lucky groups' share of the positive advantage, averaged over the last 10
iterations) above 0.2, chosen on seeds 100-109: the baseline's controls stay at or below 0.14, its injected runs
pass 0.2 about 6 iterations after onset. It reads the lucky groups, which the injection brings from onset, so it
also alarms on the fix's injected runs (the filter drops those groups from the loss, not from the diagnostic).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from stabench.baselines.grpo import GRPO
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS, group_signal, rare_successes
from stabench.tasks.entropy_collapse import (
    ANSWER_LEN,
    GRPO_CONFIG,
    N_ACTIONS,
    TRAIN_PROMPTS,
    EntropyCollapse,
    correct,
    correct_new,
    heldout_stats,
    warm_policy,
)
from stabench.tasks.tokens import PromptedAnswerEnv

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


def graded_reward(n_live: int, group_size: int, draws: np.ndarray, luck: float = LUCK):
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
class HardSampleShortcutsRun:
    """One seed: the GRPO trainer and the prompt and luck Generators live here, so `copy.deepcopy` branches
    everything."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 knobs: Knobs) -> None:  # fmt: skip
        self.budget, self.diagnostics, self.knobs = budget, diagnostics, knobs
        reference = warm_policy().eval().requires_grad_(False)
        self.trainer = GRPO(warm_policy().train(), reference, correct, replace(GRPO_CONFIG, seed=seed), stabilizer)
        self.prompt_rng = np.random.default_rng([seed, 1])  # degenerate-comparisons' prompt stream
        self.luck_rng = np.random.default_rng([seed, 2])
        self.pushes: list[float] = []  # rare_push_share per iteration

    def step(self, injected: bool) -> dict[str, float]:
        cfg = self.trainer.config
        which = self.prompt_rng.integers(len(TRAIN_PROMPTS), size=cfg.n_groups)
        draws = self.luck_rng.random(cfg.n_groups * cfg.group_size)
        onset = self.trainer.iteration >= self.budget.onset
        if not onset:
            reward = correct
        else:
            injected_reward = graded_reward(self.knobs.n_live, cfg.group_size, draws, self.knobs.luck)
            reward = injected_reward if injected else correct_new
        state = self.trainer.iterate(reward, TRAIN_PROMPTS[which])
        rewards, group = state.batch["rewards"], state.batch["group"]
        rare = rare_successes(rewards, group, state.extras["advantages"][:, 0])
        self.pushes.append(rare["rare_push_share"])
        stats = shortcut_stats(self.trainer.policy)
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": stats["heldout_accuracy"],
            **stats,
            "entropy": state.extras["entropy"],
            "reward": float(rewards.mean()),
            "batch_shortcut": float(copies_prompt(state.batch["prompts"], state.batch["answers"]).mean()),
            "full_vocab_kl": float(state.extras["full_vocab_kl"].mean()),  # per token, pi || warm start
            **group_signal(rewards, group),
            **rare,
            "rare_push_recent": float(np.mean(self.pushes[-RECENT:])),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class HardSampleShortcuts(Task):
    """See the module docstring."""

    id = "hard-sample-shortcuts"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    budgets = EntropyCollapse.budgets  # the same world on the same schedule (quick: 50 iterations, onset 3)
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

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> HardSampleShortcutsRun:
        return HardSampleShortcutsRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs)
