"""reward-model-drift: GRPO is paid by a learned reward model (RM) that keeps training on gold labels of the
policy's own samples but reads a low-dimensional summary of hidden states fitted on what the warm start wrote;
after the rule changes, the summary cannot separate the answers the new rule tells apart, the RM's errors on the
current samples are what the policy is paid for, and the new rule is not learned (seed 000 section 8; Huang et
al. 2026, R2M). The mechanism induced is feature aliasing by a stale projection, not the policy's drift as such
(see "Mechanism"). `results/calibration.md` holds the measured numbers.

The world is the digit world (`tasks.worlds.digits`): a prompt is two digits (a, b) from 0-5, an answer 3
digits (216 answers, all enumerable), the policy the same tiny GPT-2 warm start (trained on the old rule: avoid a
and b) and the same GRPO (k3 KL to the warm start at beta 0.1, clip 0.2, 8 prompts x groups of 8, Adam 2e-3, 2
epochs per batch). Before onset (iteration 1 at the quick tier) the gold rule is the old one; from onset, in both
branches, a correct answer must also avoid 5 (`correct_new`).

The reward model. Every iteration a labeler grades RM_LABELS = 16 of the batch's 64 answers by the gold rule; the
RM is a ridge regression (penalty 1e-2, closed form, refitted every iteration) on the latest RM_REPLAY = 128
labelled answers, and the policy is paid its prediction on every answer of the batch (GRPO normalizes it per
group). What it reads (`FEATURE_SOURCES`), the only difference between the branches and the fix:
- injected ("warm"): the warm-start snapshot's last hidden states at the 3 answer positions (96 numbers),
  projected on their top RM_DIM = 3 principal directions over 64 answers the warm start wrote (fitted once per
  seed at build): features that describe what the policy used to write. The RM keeps training on fresh labels.
- control ("full"): the same snapshot's 96 hidden-state numbers, not projected.
- fix (`r2m-features`, R2M): the warm features concatenated with the LIVE policy's 96 hidden-state numbers
  (detached), read anew every iteration, in both branches (the stabilizer sets the policy's `rm_features`; the
  task says it can with `provides = {"rm_features"}`, so the stabilizer acts on no other task).

Return (the true one): the learner's exact expected gold reward on the 8 held-out prompts under the new rule,
sum_a pi(a) correct_new(a), by enumeration (`heldout_accuracy`), every iteration. Ground truth:
`heldout_accuracy`, its mean over the last 25% of the run, below 0.5 (above the warm start and the frozen
policies).

Mechanism. (1) Aliasing: over all answers of the training prompts, a linear fit on the warm 3-dimensional
features predicts "holds a 5" no better than its base rate (with 2-8 principal directions alike), on the 96
unprojected numbers almost perfectly: answers with and without a 5 share their features, and the new rule's
label is not linearly readable from them. (2) The RM on current samples: within a group it orders the pairs of
answers with different gold barely better than chance (`rm_pair_accuracy`), so GRPO's advantages carry almost
nothing of the new rule, and it cannot fit even its own replayed labels (`rm_fit_error`); the policy follows the
RM's errors. (3) Ablations (prototype, the same world, 80 iterations, seeds 0-9, onset 3): what fails is the
projection fitted on the warm start's writing, and what the fix restores is the features it threw away; that
the policy's hidden states are live is not needed at this scale (a frozen snapshot's unprojected states work as
well, and the live policy's states projected on refitted principal directions fail about half the seeds). The
control is the snapshot's unprojected states rather than a refreshed projection: a snapshot refreshed every 5
iterations with its projection refitted was too noisy for a control, and the live policy refreshed every
iteration is the fix bit for bit.

Settings and where chosen (prototype on seeds 0-5 and 0-9, then the module on seeds 0-9): RM_DIM 3 (with 4
principal directions the warm projection failed on some seeds only, with 6 or 8 it learned: 3 is where the
aliasing is complete), 16 labels per iteration (32 did not change the picture), 128 replayed, 80 iterations (at 50
the learners were still learning), onset 1 (at onset 3 the frozen-at-onset policies spread too
wide to anchor the normalized return). Nothing was tuned on seeds 100-109 except the detector's threshold. The
full tier (160 iterations, onset 1) was not calibrated. Non-fixes: `kl-anchor` and `entropy-bonus` do not touch
the RM.

Detector: `rm_fit_error` (the RM's mean squared residual on its own 128 labels, visible to whoever trains it)
above 0.13, chosen on seeds 100-109 only. It alarms at onset: it sees features that cannot fit the labels (the
aliasing), not a learner that stopped. The diagnostic the source names, the RM's accuracy on current samples
(`rm_accuracy`, smoothed over 5 iterations as `rm_accuracy_recent`), is a poor detector here: every RM, the
controls' included, is wrong on the new labels for several iterations after the rule change (its replay still
holds old labels).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from stabench.baselines.tokens import lm_hidden, sample_answers
from stabench.suite.api import POLICY_REUSE, Budget, DetectorSpec, Figure, GroundTruth, Stabilizer, Task, TrainState
from stabench.tasks.worlds.digits import (
    ANSWER_LEN,
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
from torch import nn

if TYPE_CHECKING:
    import pandas as pd

# --- The reward model. -------------------------------------------------------------------------------------
RM_DIM = 3  # the RM reads a RM_DIM-dimensional projection (principal directions) of the answer's hidden states
RM_LABELS = 16  # gold labels per iteration (a labeler's budget), drawn from the current batch of 64
RM_REPLAY = 128  # the most recent labelled samples the RM is fitted on
RM_RIDGE = 1e-2  # ridge penalty of the RM's closed-form least-squares fit
WARM_SAMPLES = 64  # warm-start samples the warm-start projection is fitted on
RECENT = 5  # rm_accuracy_recent: the RM's accuracy on the labels of the last RECENT iterations (80 labels)
ACCURACY_FLOOR = 0.5  # ground truth: tail mean of the held-out expected accuracy under the new rule

# Where the RM's features come from: the injected branch ("warm": a RM_DIM-dimensional projection of the
# warm-start snapshot's hidden states on their principal directions over what the warm start wrote), the control
# ("full": the same snapshot's hidden states, not projected), and the fix ("policy", R2M: the warm features
# concatenated with the live policy's hidden states, detached, read anew every iteration). The `r2m-features`
# stabilizer sets the policy's `rm_features` attribute to "policy" (`Task.provides` "rm_features").
FEATURE_SOURCES = ("warm", "full", "policy")


class RewardModelDriftEnv(PromptedAnswerEnv):
    """One episode: a training prompt (a, b), then 3 digits; paid the gold rule the RM is fitted to (`correct`
    before onset, `correct_new` after: also avoid 5)."""

    def __init__(self, after_onset: bool = True) -> None:
        super().__init__(correct_new if after_onset else correct, TRAIN_PROMPTS, N_ACTIONS, ANSWER_LEN)


def hidden_states(model: nn.Module, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The network's last hidden states at the answer positions of prompt ++ answer, concatenated: [B, 3 * 32]."""
    with torch.no_grad():
        h = lm_hidden(model, torch.cat([prompts, answers], 1))
    return h[:, prompts.shape[1] :, :].reshape(len(answers), -1).double()


def principal_directions(h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and the top-k principal directions [d, k] of the rows of h."""
    mean = h.mean(0)
    _, _, v = torch.linalg.svd(h - mean, full_matrices=False)
    return mean, v[:k].T


def with_constant(z: torch.Tensor) -> torch.Tensor:
    """Features with a constant column appended (the RM's bias)."""
    return torch.cat([z, torch.ones(len(z), 1, dtype=z.dtype)], 1)


def ridge_fit(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Least squares with a small ridge penalty, x already holding its constant column: weights [d]."""
    a = x.T @ x + RM_RIDGE * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(a, x.T @ y)


def pair_accuracy(pred: torch.Tensor, gold: torch.Tensor, group: torch.Tensor) -> float:
    """Among pairs of answers of one group with different gold, the share the RM orders as the gold does."""
    same = group[:, None] == group[None, :]
    better = same & (gold[:, None] > gold[None, :])
    n = int(better.sum())
    return float((better & (pred[:, None] > pred[None, :])).sum()) / n if n else float("nan")


class Features:
    """The injected RM's feature map: the frozen warm-start snapshot's hidden states, projected on their
    principal directions over what the warm start wrote (with the constant column)."""

    def __init__(self, snapshot: nn.Module, projection: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.snapshot, self.projection = snapshot, projection

    def __call__(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        mean, v = self.projection
        return with_constant((hidden_states(self.snapshot, prompts, answers) - mean) @ v)


class RewardModelDriftRun(GRPORun):
    """One seed of GRPO on the digit world; the RM's replay and snapshot and the label Generator live here too,
    so `copy.deepcopy` branches everything."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=GRPO_CONFIG,
                         default_reward=correct, prompts=TRAIN_PROMPTS)  # fmt: skip
        self.label_rng = np.random.default_rng([seed, 2])
        snapshot = warm_policy().eval().requires_grad_(False)
        which = self.prompt_rng.integers(len(TRAIN_PROMPTS), size=WARM_SAMPLES // GRPO_CONFIG.group_size)
        prompts = TRAIN_PROMPTS[which].repeat_interleave(GRPO_CONFIG.group_size, 0)
        answers = sample_answers(snapshot, prompts, ANSWER_LEN, N_ACTIONS, np.random.default_rng([seed, 3]))
        self.warm = Features(snapshot, principal_directions(hidden_states(snapshot, prompts, answers), RM_DIM))
        self.replay_prompts = torch.zeros(0, TRAIN_PROMPTS.shape[1], dtype=torch.long)
        self.replay_answers = torch.zeros(0, ANSWER_LEN, dtype=torch.long)
        self.replay_labels = torch.zeros(0, dtype=torch.float64)
        self.info: dict[str, float] = {}
        self.accuracies = Trailing(RECENT)

    def source(self, injected: bool) -> str:
        if getattr(self.trainer.policy, "rm_features", None) == "policy":
            return "policy"
        return "warm" if injected or self.trainer.iteration < self.budget.onset else "full"

    def feature_map(self, source: str):
        """The RM's features of this iteration, a function of (prompts, answers) (see FEATURE_SOURCES)."""
        warm = self.warm
        if source == "warm":
            return warm
        if source == "full":
            return lambda p, a: with_constant(hidden_states(warm.snapshot, p, a))
        policy = self.trainer.policy
        return lambda p, a: torch.cat([warm(p, a)[:, :-1],
                                       with_constant(hidden_states(policy, p, a))], 1)  # fmt: skip

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        """The RM's prediction, refitted on this iteration's labels; what it measures goes to `self.info`."""
        self.info = {"rm_accuracy": float("nan")}
        rule = correct_new if after_onset else correct
        source = self.source(injected)

        def reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
            pick = torch.as_tensor(self.label_rng.choice(len(answers), RM_LABELS, replace=False))
            labels = rule(prompts[pick], answers[pick]).double()
            info = self.info
            if len(self.replay_labels):  # the RM before this iteration's labels, judged on them: its accuracy
                features = self.feature_map(source)
                w = ridge_fit(features(self.replay_prompts, self.replay_answers), self.replay_labels)
                info["rm_accuracy"] = float(((features(prompts[pick], answers[pick]) @ w > 0.5).double()
                                             == labels).double().mean())  # fmt: skip
            self.replay_prompts = torch.cat([self.replay_prompts, prompts[pick]])[-RM_REPLAY:]
            self.replay_answers = torch.cat([self.replay_answers, answers[pick]])[-RM_REPLAY:]
            self.replay_labels = torch.cat([self.replay_labels, labels])[-RM_REPLAY:]
            features = self.feature_map(source)
            x = features(self.replay_prompts, self.replay_answers)
            w = ridge_fit(x, self.replay_labels)
            info["rm_fit_error"] = float((x @ w - self.replay_labels).pow(2).mean())  # on its own labels
            pred = features(prompts, answers) @ w
            gold = rule(prompts, answers).double()
            info["rm_gold_gap"] = float((pred - gold).abs().mean())
            info["rm_batch_accuracy"] = float(((pred > 0.5).double() == gold).double().mean())
            group = torch.arange(len(answers)) // self.trainer.config.group_size
            info["rm_pair_accuracy"] = pair_accuracy(pred, gold, group)
            info["batch_gold"] = float(gold.mean())
            return pred.float()

        return reward

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        stats = self.evaluate(heldout_stats, self.trainer.policy)
        if np.isfinite(self.info["rm_accuracy"]):
            self.accuracies.push(self.info["rm_accuracy"])
        return {
            "step": float(self.trainer.tokens),
            "return": stats["heldout_accuracy"],
            "heldout_accuracy": stats["heldout_accuracy"],
            "old_rule_accuracy": stats["old_rule_accuracy"],
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            **self.info,
            "rm_accuracy_recent": self.accuracies.mean() if self.accuracies.values else float("nan"),
        }


# --- The figure. -------------------------------------------------------------------------------------------
def draw_reward_model(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Held-out accuracy beside how well the reward model orders and fits the current samples."""
    from stabench.suite import figures

    panels = [("heldout_accuracy", "exact held-out accuracy (new rule)"),
              ("rm_pair_accuracy", "RM orders within-group pairs as gold does"),
              ("rm_fit_error", "RM residual on its own labels")]  # fmt: skip
    return figures.fix_against_baseline(table, "reward-model-drift", panels, out, name)


class RewardModelDrift(Task):
    """See the module docstring."""

    id = "reward-model-drift"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=6, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=80, onset=1, seeds=5),
        "full": Budget(iterations=160, onset=1, seeds=10),
    }
    ground_truth = GroundTruth(
        metric="heldout_accuracy", threshold=ACCURACY_FLOOR, fails_when="below", reduce="tail_mean"
    )
    provides = frozenset({"rm_features", POLICY_REUSE})  # POLICY_REUSE: 2 epochs per batch (the digit config)
    matched_fix = "r2m-features"
    methods = ("baseline", "r2m-features", "kl-anchor", "entropy-bonus")
    # the RM cannot fit its own labels: threshold chosen on seeds 100-109 only (see the module docstring)
    detector = DetectorSpec(metric="rm_fit_error", threshold=0.13, above=True)
    diagnostics = ("grad_norms",)
    privileged = ("heldout_accuracy", "old_rule_accuracy", "rm_gold_gap", "rm_batch_accuracy", "rm_pair_accuracy",
                  "batch_gold")  # fmt: skip
    return_floor = 0.3187  # frozen-at-onset: its post-onset return (held-out accuracy), mean of seeds 0-9
    return_ceiling = 0.6982  # the control (baseline method): its post-onset return, mean of seeds 0-9
    environments = {"stabench/RewardModelDrift-v0": "RewardModelDriftEnv"}
    figures = (
        Figure(
            "reward-model",
            "a reward model on stale features",
            "reward-model-drift: exact held-out accuracy, how often the reward model orders within-group pairs as "
            "the gold reward does, and its residual on its own labels, baseline and R2M features, injected and "
            "control.",
            draw_reward_model,
        ),
    )
    paper = """On reward-model-drift the policy is paid by a reward model that keeps training, refitted every
iteration on 16 gold labels of the policy's own answers, but reading three principal directions of the warm
start's hidden states, fitted on what the warm start wrote. After the rule change those directions cannot tell
answers with a 5 from answers without one (a linear fit on them predicts it at its base rate, on the unprojected
states almost perfectly): the reward model orders within-group pairs only slightly better than chance
({tail_mean:rm_pair_accuracy:baseline}, the control's {tail_mean:rm_pair_accuracy:baseline:control}), and the
policy follows its errors ({failed:baseline} seeds fail). Letting the reward model also read the live policy's
hidden states (R2M) fails {failed:r2m-features} seeds; a frozen snapshot's unprojected states do as well, so what this
task measures is features that stop describing what matters, not the drift of the policy as such."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> RewardModelDriftRun:
        return RewardModelDriftRun(self.budget(tier), seed, stabilizer, self.diagnostics)
