"""inference-mismatch (experimental): from onset the answers come from an inference sampler that is a distorted
copy of the learner (a logit soft-cap), and GRPO forms its on-policy objective on them without correcting for
mu != pi (Zheng et al. 2025, seed 003). At this scale the mismatch does not make the learner fail: the task
misses the bar and stays experimental (`results/calibration.md` holds the measured numbers).

The world is the digit world (`tasks.worlds.digits`): a prompt is two digits (a, b) from 0-5, an answer 3
digits (216 answers, all enumerable), the policy the tiny GPT-2 warm start (1 layer, 32 wide, built from a
config). Before onset a correct answer avoids a and b; from onset it must also avoid 5 (`correct_new`), which
the warm start writes often. Both branches are paid the gold verifier on every group, so both must learn the
new rule.

The trainer. GRPO on-policy (one Adam step per batch, lr 2e-3, 8 prompts x groups of 8, no KL term: beta 0).
The learner recomputes pi_old and forms its term against it (`anchor_logp`), as a pipeline that recomputes
old log-probs does; the sampler's log-probs mu reach the hooks as `behaviour_logp` and the trainer never
reads them.

The injection. From onset the injected branch samples from `SoftCapSampler`: the learner's weights with a
logit soft-cap the learner lacks, z -> c tanh((z - max z) / c), c = 2 (an engine that caps logits, as some
kernels do). It fattens the sampler's tail, and the more the learner sharpens, the more the two differ: the
training-inference gap grows with learning. The control's sampler is the learner itself (bit-identical).

Return (the true one): the learner's exact expected reward on the 8 held-out prompts under the new rule,
sum_a pi(a) correct_new(a), by enumeration (`heldout_accuracy`). Ground truth: `heldout_accuracy`, its mean over
the last 25% of the run below 0.6 (between the policies frozen at onset and the control). Also exact per row:
`gt_engine_kl`, the per-answer KL(mu || pi) over the held-out prompts between the branch's sampler and the
learner (0 when the learner samples).

Fix and non-fixes. Matched fix (the paper's): token-level truncated importance sampling against the
sampler's log-probs, sg[min(pi_old / mu, 2)] on each token's term (`token-tis`); also sequence-level
(`seq-tis`). Named non-fixes: PPO clipping against pi_old (`clip-higher`: on-policy its ratio is 1, so it never
binds) and an entropy bonus (`entropy-bonus`).

Why no failure. With a binary reward every advantage has the right sign whoever sampled the answer, and in a
softmax policy any positive reweighting of right-signed per-answer updates still ascends the expected reward;
the bias only sharpens the learner: its entropy falls faster than the corrected learners'. What the paper's
collapse needs (a long answer whose credit depends on the sampler's continuation, a large model whose logit
error grows with training, graded rewards) is not present in 3-token answers. The task is the suite's measured
statement that a training-inference mismatch of this kind is benign for a small on-policy learner, and it
carries the engine-gap diagnostics (`engine_gap`).

Settings and where they were chosen (prototype, seeds 0-2 each, then the calibration on seeds 0-9): every
sampler distortion tried left the learner learning, namely logit soft-caps c = 1.5, 2, 3, mixtures with the
uniform distribution (1 - eps) pi + eps / 6 at eps 0.3, 0.5, 0.6, learning rates 2e-3 to 6e-3, and a variant
that paid partial credit for an abstain token only the sampler wrote; c = 2 is kept. Detector: `engine_kl` (the
batch's k1 estimate of KL(mu || pi_old) per token) above 0.1, verl's health warning.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, StabenchError, Stabilizer, Task, TrainState
from stabench.tasks.worlds import digits
from stabench.tasks.worlds.digits import (
    ANSWER_LEN,
    BUDGETS,
    HELDOUT_CORRECT,
    N_ACTIONS,
    TRAIN_PROMPTS,
    correct,
    correct_new,
    heldout_logp,
    warm_policy,
)
from stabench.tasks.worlds.scaffold import GRPORun
from stabench.tasks.worlds.tokens import PromptedAnswerEnv, RewardFn
from torch import nn

if TYPE_CHECKING:
    import pandas as pd

# --- The trainer and the sampler. --------------------------------------------------------------------------
GRPO_CONFIG = replace(digits.GRPO_CONFIG, beta=0.0, epochs=1)  # on-policy: one Adam step per batch, no KL term
SOFT_CAP = 2.0  # c of the injected sampler's logit soft-cap
ACCURACY_FLOOR = 0.6  # ground truth: tail mean of the held-out expected accuracy


class _Logits:
    """What a causal LM's forward returns, as far as the token machinery reads it."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class SoftCapSampler(nn.Module):
    """The learner's weights served with a logit soft-cap: answer-token logits z -> c tanh((z - max z) / c).

    Called like the policy (`sampler(input_ids=..., use_cache=False).logits`); the special token keeps a
    logit far below every answer token, so the sampler never emits it. It shares the learner's parameters
    (a list, so that they are not registered twice) and follows every update.
    """

    def __init__(self, policy: nn.Module, cap: float = SOFT_CAP) -> None:
        super().__init__()
        self._policy, self.cap = [policy], cap

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> _Logits:
        logits = self._policy[0](input_ids=input_ids, use_cache=False).logits
        z = logits[..., :N_ACTIONS]
        capped = self.cap * torch.tanh((z - z.max(-1, keepdim=True).values) / self.cap)
        out = torch.full_like(logits, -1e4)
        out[..., :N_ACTIONS] = capped
        return _Logits(out)


# --- The environment: one answer to a prompt, paid by the rule in force. -----------------------------------
class InferenceMismatchEnv(PromptedAnswerEnv):
    """One episode: a training prompt (a, b), then an answer of ANSWER_LEN digits (observation: a, b, the answer
    so far). Reward at the last digit: `correct` before onset (`after_onset=False`), `correct_new` after. The
    sampler mismatch is a property of who draws the actions, not of the environment."""

    def __init__(self, after_onset: bool = True) -> None:
        super().__init__(correct_new if after_onset else correct, TRAIN_PROMPTS, N_ACTIONS, ANSWER_LEN)


# --- Exact evaluation on the held-out prompts. -------------------------------------------------------------
def heldout_stats(policy: nn.Module, sampler: nn.Module | None) -> dict[str, float]:
    """The learner's exact held-out accuracy under the new rule, and the exact per-answer KL(mu || pi)."""
    logp = heldout_logp(policy)
    kl = 0.0
    if sampler is not None:
        mu_logp = heldout_logp(sampler)
        kl = float((mu_logp.exp() * (mu_logp - logp)).sum(-1).mean())
    return {"heldout_accuracy": float((logp.exp() * HELDOUT_CORRECT).sum(-1).mean()), "gt_engine_kl": kl}


# --- Knobs. ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """`InferenceMismatch(**knobs)`; the defaults are the registered task."""

    cap: float = SOFT_CAP  # the injected sampler's soft-cap c

    def check(self, shortest_run: int) -> None:
        ok = isinstance(self.cap, (int, float)) and not isinstance(self.cap, bool)
        if not (ok and self.cap > 0):
            raise StabenchError(f"inference-mismatch: cap must be a positive number, got {self.cap!r}")


# --- One run. ----------------------------------------------------------------------------------------------
class InferenceMismatchRun(GRPORun):
    """One seed of GRPO on the digit world; the sampler is rebuilt around the branch's own policy each step, so
    `copy.deepcopy` branches it with everything else."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 cap: float) -> None:  # fmt: skip
        # the reference is unused at beta 0; the trainer requires one
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=GRPO_CONFIG,
                         default_reward=correct, prompts=TRAIN_PROMPTS)  # fmt: skip
        self.cap = cap
        self.engine: SoftCapSampler | None = None

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        return correct_new if after_onset else correct

    def sampler(self, injected: bool, after_onset: bool) -> nn.Module | None:
        """The injected branch samples from the soft-capped engine from onset (kept for `row`'s statistics)."""
        self.engine = SoftCapSampler(self.trainer.policy, self.cap) if injected and after_onset else None
        return self.engine

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        stats = heldout_stats(self.trainer.policy, self.engine)
        return {
            "step": float(self.trainer.tokens),
            "return": stats["heldout_accuracy"],
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            **stats,
        }


# --- The figure. -------------------------------------------------------------------------------------------
def draw_engine_kl(table: pd.DataFrame, out: Path) -> list[Path]:
    """The training-inference KL over training and against each run's normalized return."""
    from stabench.suite import figures

    rows = figures.need(table, "inference-mismatch", "engine_kl")
    return figures.gap_against_return(rows, "engine_kl", "training-inference KL E_mu[log mu - log pi_old]", out,
                                      "15_inference_mismatch")  # fmt: skip


class InferenceMismatch(Task):
    """See the module docstring."""

    id = "inference-mismatch"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    experimental = True
    budgets = BUDGETS  # the digit world's schedule (quick: 50 iterations, onset 3)
    ground_truth = GroundTruth(
        metric="heldout_accuracy", threshold=ACCURACY_FLOOR, fails_when="below", reduce="tail_mean"
    )
    matched_fix = "token-tis"
    methods = ("baseline", "token-tis", "seq-tis", "clip-higher", "entropy-bonus")
    # the gap the paper watches: KL(mu || pi_old) per token on the batch (k1), above 0.1 (verl's health warning)
    detector = DetectorSpec(metric="engine_kl", threshold=0.1, above=True)
    diagnostics = ("engine_gap", "grad_norms")
    privileged = ("heldout_accuracy", "gt_engine_kl")
    return_floor = 0.3187  # frozen-at-onset's post-onset return, mean of seeds 0-9 (exact per seed)
    return_ceiling = 0.7558  # the control's post-onset return, mean of seeds 0-9
    knobs_type = Knobs
    environments = {"stabench/InferenceMismatch-v0": "InferenceMismatchEnv"}
    figures = (
        Figure(
            "15_inference_mismatch",
            "training-inference KL against return",
            "inference-mismatch: the training-inference KL over training (left) and against each run's "
            "normalized return (right).",
            draw_engine_kl,
        ),
    )
    paper = """On inference-mismatch the answers come, from onset, from an inference sampler that is a soft-capped
copy of the learner, and GRPO trains on them as if the learner had drawn them, without correcting for the
difference. The failure Zheng et al. (2025) report did not appear at this scale, and the task stays
experimental: a sampler whose soft-capped logits put 2-3 nats of KL per answer between it and the learner only
sharpens the uncorrected learner, which learns the new rule like the control. The figure below shows the
training-inference KL and the return of every run."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> InferenceMismatchRun:
        return InferenceMismatchRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.cap)
