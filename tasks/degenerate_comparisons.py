"""degenerate-comparisons: after onset 7 of GRPO's 8 groups are solved or unsolvable problems (all correct or
all wrong: zero reward variance) while a new rule must be learned from the one group that compares (seed
002). Measured: the silent groups add nothing to the policy term but keep their share of the KL term, so the
pull back to the warm start outweighs the live group's signal and the rule is learned only in part.

The world is entropy-collapse's (`tasks.entropy_collapse`): a prompt is two digits (a, b) from 0-5, an answer
3 digits (216 answers, all enumerable), the policy the same tiny GPT-2 warm start and the same GRPO (k3 KL to
the warm start at beta 0.1, clip 0.2, 8 prompts x groups of 8, Adam 2e-3, 2 epochs per batch, token-mean
aggregation). Before onset a correct answer avoids a and b; from onset it must also avoid 5 (`correct_new`),
which the warm start writes often (held-out accuracy about 0.33): both branches must learn it.

The injection. From onset the injected branch's batches hold `N_LIVE` = 1 group graded by the new rule and 7
degenerate groups: 4 of problems the policy always solves and 3 it never solves. Their grade does not depend
on the answer (modelled as a constant 1 or 0 per group: a solved or an unsolvable problem), so their reward
variance is 0 and so is every advantage in them. The control's 8 groups are all graded by the new rule.

Return (the true one): the learner's exact expected reward on the 8 held-out prompts under the new rule,
sum_a pi(a) correct_new(a), by enumeration (`heldout_accuracy`).
- `return_floor`: the policy frozen at onset (`frozen-at-onset`), its post-onset return, mean of seeds 0-9.
- `return_ceiling`: the control's (baseline method, control branch) post-onset return, mean of seeds 0-9.
Ground truth: `heldout_accuracy`, its mean over the last 25% of the run below 0.7 (the frozen policies hold
0.28-0.35; the control ends at 0.77-0.92 on seeds 0-9).

Fix and non-fixes. Matched fix: `variance-filter` (DAPO's dynamic-sampling filter without the resampling):
zero-variance groups leave every term of the loss, the others keep the trainer's total weight. Named
non-fixes: an entropy bonus (`entropy-bonus`), clip-higher. Not run: "a larger batch at the same compute"
(a batch size is the task's trainer setting, not a stabilizer hook).

Mechanism, as measured: not a lack of gradient but a regularizer that outweighs it. A degenerate group adds
nothing to the policy term but its tokens still carry the KL term, on prompts like the live ones; with 7 of
8 groups silent, the token-mean policy term is 1/8 of the control's while the KL term is whole, so the pull
back to the warm start wins (as if beta were 8 times larger) and the policy learns a fraction of the rule.
At beta 0 the same injection barely hurts (prototype, seeds 0-3: tail accuracy 0.74-0.92 against the
control's 0.87-0.97): Adam rescales a policy term that is only smaller. Removing the degenerate groups from
every term restores the control's ratio, and one live group per batch then suffices to learn the rule.

Settings and where they were chosen (prototype on seeds 0-3, then seeds 0-9): 1 live group of 8 (2 live
groups left the baseline at 0.67-0.70, too near the fix's 0.79-0.89), beta 0.1 (entropy-collapse's; 0.2 slowed
the control to 0.80-0.86 and the fix to 0.61-0.77), the threshold 0.7 between the baseline's 0.51-0.57 and the
fix's 0.76-0.92 (seeds 0-9). Nothing was tuned on seeds 100-109.

Numbers (quick tier: onset 3, 50 iterations; 10 seeds; normalized return with its 95% bootstrap interval;
tail = the held-out accuracy over the last 25% of the run):
  seeds 0-9                  failed  control failed  normalized return    tail accuracy (per seed)
    baseline                 10/10   0/10            0.39 [0.35, 0.44]    0.50-0.57 (control 0.78-0.92)
    variance-filter (fix)     0/10   0/10            0.75 [0.66, 0.83]    0.75-0.91
    clip-higher              10/10   0/10            0.39 [0.35, 0.44]    as the baseline's
    entropy-bonus            10/10   0/10            0.30 [0.26, 0.34]    0.42-0.55 (a third undiluted term)
    frozen-at-onset          10/10   10/10           0.00                 0.20-0.39
    no-update                10/10   10/10           0.02                 0.33
  seeds 100-109 (fresh)
    baseline                 10/10   0/10            0.44 [0.39, 0.49]    0.44-0.67
    variance-filter (fix)     1/10   0/10            0.81 [0.76, 0.86]    0.69-0.88
    references               10/10   10/10           at most 0.03
In the method matrix (`results/matrix`, seeds 0-9) one other method lifts it: `kl-k2-anchor`, which replaces the
trainer's k3 term at beta 0.1 by k2 at 0.05, fails 3/10 (0.62): a weaker anchor is part of the same cure.
`kl-anchor`, which adds 0.3 k3 to it, does worst (0.17), as the mechanism says it should.
In the tail the baseline's policy stays near the warm start (per-token KL to it 0.09 against the control's
0.41, entropy 1.42 against 0.99) while 90% of its groups are silent. A quick-tier trial (healthy phase and
both branches) takes 2.3 s on one shared core (median).
Detector: `zero_variance_recent` (the zero-variance share averaged over the last 10 iterations) above 0.85,
chosen on seeds 100-109: it fires on every injected run 9 iterations after onset (median) and on no
baseline control (their highest 0.76; one of the variance filter's controls late, at iteration 41). It reads
the injection itself (7 of 8 groups silent from onset), so it also alarms on the fix's injected runs, which
stay healthy; one iteration's share is too noisy to use (a learning control has batches where every group is
solved: it exceeds 0.85 in every control run of seeds 100-109).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from stabench.baselines.grpo import GRPO
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS, group_signal
from stabench.tasks.entropy_collapse import (
    ANSWER_LEN,
    GRPO_CONFIG,
    N_ACTIONS,
    TRAIN_PROMPTS,
    EntropyCollapse,
    correct,
    correct_new,
    heldout_accuracy,
    warm_policy,
)
from stabench.tasks.tokens import PromptedAnswerEnv

N_LIVE = 1  # groups per injected batch graded by the new rule; the rest are degenerate
ACCURACY_FLOOR = 0.7  # ground truth: tail mean of the held-out expected accuracy
GRADES = ("live", "solved", "unsolvable")
RECENT = 10  # zero_variance_recent: the mean zero-variance share over the last RECENT iterations


def degenerate_grades(n_groups: int, n_live: int = N_LIVE) -> list[str]:
    """The grade of each group of an injected batch: `n_live` live groups, then solved and unsolvable ones
    (solved first, one more of them when the count is odd)."""
    rest = n_groups - n_live
    return ["live"] * n_live + ["solved"] * ((rest + 1) // 2) + ["unsolvable"] * (rest // 2)


def graded_reward(grades: list[str], group_size: int):
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
class DegenerateComparisonsRun:
    """One seed: the GRPO trainer and the prompt Generator live here, so `copy.deepcopy` branches everything."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 n_live: int) -> None:  # fmt: skip
        self.budget, self.diagnostics = budget, diagnostics
        reference = warm_policy().eval().requires_grad_(False)
        self.trainer = GRPO(warm_policy().train(), reference, correct, replace(GRPO_CONFIG, seed=seed), stabilizer)
        self.prompt_rng = np.random.default_rng([seed, 1])
        cfg = self.trainer.config
        self.injected_reward = graded_reward(degenerate_grades(cfg.n_groups, n_live), cfg.group_size)
        self.silent: list[float] = []  # zero_variance_share per iteration

    def step(self, injected: bool) -> dict[str, float]:
        which = self.prompt_rng.integers(len(TRAIN_PROMPTS), size=self.trainer.config.n_groups)
        onset = self.trainer.iteration >= self.budget.onset
        reward = (self.injected_reward if injected else correct_new) if onset else correct
        state = self.trainer.iterate(reward, TRAIN_PROMPTS[which])
        signal = group_signal(state.batch["rewards"], state.batch["group"])
        self.silent.append(signal["zero_variance_share"])
        accuracy = heldout_accuracy(self.trainer.policy)
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": accuracy,
            "heldout_accuracy": accuracy,
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            "full_vocab_kl": float(state.extras["full_vocab_kl"].mean()),  # per token, pi || warm start
            **signal,
            "zero_variance_recent": float(np.mean(self.silent[-RECENT:])),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class DegenerateComparisons(Task):
    """See the module docstring."""

    id = "degenerate-comparisons"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    budgets = EntropyCollapse.budgets  # the same world on the same schedule (quick: 50 iterations, onset 3)
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

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> DegenerateComparisonsRun:
        return DegenerateComparisonsRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.n_live)
