"""plasticity-loss: from onset the injected branch trains without a KL anchor on a reward that favours answers
with a 5, drifting far from its warm start; then the rule changes (a correct answer must avoid 5) and it cannot
learn it, while the low-drift control does (seed 002). Measured: the drifted policy has collapsed onto answers
the new rule forbids, so after the change its groups are all wrong or all right, GRPO's advantages are zero, and
with no pull back to the warm start nothing restores the correct answers: the post-change learning rate is 0.

The world is entropy-collapse's (`tasks.entropy_collapse`): a prompt is two digits (a, b) from 0-5, an answer 3
digits (216 answers, all enumerable), the policy the same tiny GPT-2 warm start and the same GRPO (k3 KL to the
warm start at beta 0.1, clip 0.2, 8 prompts x groups of 8, Adam 2e-3, 2 epochs per batch, token-mean
aggregation).

The schedule. Iterations [0, onset): the old rule (avoid a and b), shared by both branches. From onset (the
branch point) a drift phase of `DRIFT` iterations (15 at the quick tier): the control keeps the old rule and the
trainer's KL term; the injected branch loses its KL term (beta 0, for the rest of the run) and is paid the old
rule with a bonus for a 5, `correct * (1 + has_five)` (`drift_reward`): a sharpening reward, as a long run on a
narrow objective is. At `shift` = onset + DRIFT the rule changes in both branches: a correct answer must also
avoid 5 (`correct_new`); both must learn it (the warm start's held-out accuracy under it is 0.33).

Return (the true one): the learner's exact expected reward on the 8 held-out prompts under the new rule (held-out
prompts hold no 5), sum_a pi(a) correct_new(a), by enumeration (`heldout_accuracy`), at every iteration.
- `return_floor`: the policy frozen at onset (the branch point), its post-onset return, mean of seeds 0-9.
- `return_ceiling`: the control's (baseline method, control branch) post-onset return, mean of seeds 0-9 (the
  drift phase included: the control's accuracy under the new rule stays near the warm start's until the shift).
Ground truth: `heldout_accuracy`, its mean over the last 25% of the run (all after the shift) below 0.5.

Fix and non-fixes. Matched fix: `kl-anchor` (0.3 x k3 to the warm start beside the trainer's term, in every
phase: the trainer's own term is off in the injected branch, the anchor is not). Named non-fixes: `clip-higher`
(a larger upper clip scales advantages that are zero), `entropy-bonus` (measured as a partial guard: its exact
entropy gradient spreads probability even where advantages are zero).

Mechanism, as measured in the prototype (seeds 0-9 and 100-109), at the shift: the baseline's held-out
probability on new-rule-correct answers is at most 0.002 (it writes 555 on every held-out prompt), the control's
0.20-0.53, the anchored run's 0.04-0.14; the exact sequence KL to the warm start 3.3-4.0 nats against 0.2-1.4
and 0.6-1.4. In the first 10 iterations after the shift 79-97% of the baseline's groups have zero reward variance
(53-69% all wrong; on training prompts that hold a 5 it writes answers without one, all right), against 33-46% in
the control; its post-shift learning rate is 0.000 per iteration (control 0.016-0.035, anchored 0.029-0.034).
Both factors are needed: without the bonus (no KL, drift onto answers the new rule allows) the baseline learns
(0/10 fail, 0.84-0.99); with the bonus but the trainer's KL back after the shift it learns too (0/10, 0.70-0.86):
the k3 gradient restores mass with no reward signal. A large drift predicts the stall only where nothing pulls
back afterwards: the control given the same bonus at beta 0.1 drifts 2.0-2.8 nats and still learns.

Settings and where they were chosen (prototype on seeds 0-9): DRIFT 15 (8 left 4/10 baselines learning, 10 one,
15 and 20 none), the bonus 1 gated by the old rule, beta 0 after the shift in the injected branch (the ablations
above), the threshold 0.5 between the frozen policies' best (0.39) and the fix's worst (0.69), 60 iterations
(at 80 one baseline creeps to 0.45: the stall is not absolute on long runs). Nothing was tuned on seeds 100-109
except the detector's threshold.

Numbers (quick tier: onset 3, shift 18, 60 iterations; 10 seeds; normalized return with its 95% bootstrap
interval; tail = the held-out accuracy over the last 25% of the run):
  seeds 0-9                  failed  control failed  normalized return     tail accuracy (per seed)
    baseline                 10/10   0/10            -0.80 [-0.82, -0.79]  0.00-0.09 (control 0.82-0.90)
    kl-anchor (fix)           0/10   0/10            0.52 [0.48, 0.57]     0.69-0.81 (its control 0.67-0.76)
    clip-higher              10/10   0/10            -0.81 [-0.83, -0.80]  0.00
    entropy-bonus             3/10   0/10            -0.18 [-0.36, 0.00]   0.19-0.89
    frozen-at-onset          10/10   10/10           0.00                  0.20-0.39
    no-update                10/10   10/10           0.03                  0.33
  seeds 100-109 (fresh)
    baseline                 10/10   0/10            -0.78 [-0.81, -0.71]  0.00-0.36
    kl-anchor (fix)           0/10   0/10            0.55 [0.53, 0.58]     0.72-0.78
    clip-higher               9/10   0/10            -0.66                 0.00-0.94
    entropy-bonus             1/10   0/10            -0.08                 0.42-0.91
    references               10/10   10/10           at most 0.05
The baseline's normalized return is below 0: during the drift its accuracy under the new rule falls from the
frozen policy's 0.31 to 0, so it spends most of the post-onset phase below the floor. The fix's is about half the
control's reach: the anchor slows the control's learning too (its control ends at 0.67-0.76). A quick-tier trial
(healthy phase and both branches) takes 5.2 s (median, two trials sharing the 2 cores).
Detector: `full_vocab_kl` (the per-token KL of the sampled batch to the warm start) above 0.8, chosen on seeds
100-109: every control stays at or below 0.76 (it rises after the shift, as the control learns), every baseline
injected run passes 0.8 at iteration 12-20, before the shift at 18 in 9 of 10. The anchored runs stay below
0.48; the entropy bonus's injected runs pass it (0.98-1.62) and learn in 9 of 10, so it also alarms on them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from stabench.baselines.grpo import GRPO
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS, group_means, group_signal
from stabench.tasks.entropy_collapse import (
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
from stabench.tasks.tokens import PromptedAnswerEnv

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


def learning_rate(accuracy: list[float], window: int = SLOPE_WINDOW) -> float:
    """Held-out accuracy gained per iteration over the last `window` iterations (fewer at the start)."""
    recent = accuracy[-window - 1 :]
    return (recent[-1] - recent[0]) / max(1, len(recent) - 1)


class PlasticityLossRun:
    """One seed: the GRPO trainer and the prompt Generator live here, so `copy.deepcopy` branches everything."""

    def __init__(self, budget: Budget, drift: int, seed: int, stabilizer: Stabilizer,
                 diagnostics: tuple[str, ...]) -> None:  # fmt: skip
        self.budget, self.diagnostics = budget, diagnostics
        self.shift = budget.onset + drift
        reference = warm_policy().eval().requires_grad_(False)
        self.trainer = GRPO(warm_policy().train(), reference, correct, replace(GRPO_CONFIG, seed=seed), stabilizer)
        self.prompt_rng = np.random.default_rng([seed, 1])
        self.accuracy: list[float] = []

    def step(self, injected: bool) -> dict[str, float]:
        it = self.trainer.iteration
        which = self.prompt_rng.integers(len(TRAIN_PROMPTS), size=self.trainer.config.n_groups)
        if it >= self.budget.onset and injected:
            self.trainer.config = replace(self.trainer.config, beta=0.0)  # the KL term is off from the branch point
        if it < self.budget.onset:
            reward = correct
        elif it < self.shift:
            reward = drift_reward if injected else correct
        else:
            reward = correct_new
        state = self.trainer.iterate(reward, TRAIN_PROMPTS[which])
        stats = heldout_stats(self.trainer.policy)
        self.accuracy.append(stats["heldout_accuracy"])
        rewards, group = state.batch["rewards"], state.batch["group"]
        row: dict[str, float] = {
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
            "after_shift": float(it >= self.shift),
            **group_signal(rewards, group),
            "all_wrong_share": all_wrong_share(rewards, group),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class PlasticityLoss(Task):
    """See the module docstring."""

    id = "plasticity-loss"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
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

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> PlasticityLossRun:
        return PlasticityLossRun(self.budget(tier), DRIFT[tier], seed, stabilizer, self.diagnostics)
