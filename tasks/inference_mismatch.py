"""inference-mismatch: from onset the answers come from an inference sampler that writes the continuation
worse than the learner would, GRPO credits an early token with the sampler's failures without correcting
for mu != pi (Zheng et al. 2025, seed 003), and the learner abandons a path it could complete itself
(version 3 meets the bar on seeds 0-9 and its failure-rate checks on fresh seeds 100-109; see
results/calibration.md).

The world (the digit world's prompts, `tasks.worlds.digits`): a prompt is two digits (a, b) from 0-5 (28
training prompts, 8 held out); an answer is 6 digits (6 ** 6 answers). The policy is a tiny GPT-2 (1 layer,
32 wide, built from a config), warmed up by 100 supervised steps on answers of uniformly drawn digits
avoiding a and b whose first digit is set to 5 with probability 0.5 (`warm_up`, fixed per task version,
shipped as a hash-checked file): it takes the risky path often and completes it well, not always.

What must be learned after onset (both branches). Before onset the old rule pays (every digit avoids a and
b). From onset `risky_rule` pays: a first digit 5 (the risky path) pays 1 if digits 2-6 avoid a and b, else
0; any other first digit (the safe path) pays a flat 0.65. The optimum is the risky path completed (1); the
policy at onset takes it about half the time and completes it imperfectly, so both branches must learn to
choose it and to complete it.

The trainer. On-policy GRPO (`baselines/grpo.py`): 8 prompts x groups of 8, one Adam step per batch (lr 3e-3),
no KL term (beta 0), group-normalized advantages. The learner recomputes pi_old and forms its term against it
(`anchor_logp`), as a pipeline that recomputes old log-probs does; the sampler's log-probs mu reach the hooks
as `behaviour_logp` and the baseline never reads them.

The injection. From onset the injected branch samples from `ContinuationSampler`: the learner's own weights
with the logits of digits 2-6 divided by a temperature 4 (the first digit untouched), an engine whose
continuations are noisier than the learner's. The control's sampler is the learner itself (bit-identical).

Mechanism (as measured, `gt_risky_share`, `gt_completion`, `gt_engine_completion`). The sampler completes the
risky path far less often than the learner (`gt_engine_completion` below `gt_completion`), so in the sampled
batch a first digit 5 earns less than the safe path's 0.65. Uncorrected GRPO credits the first digit with
the sampler's failures: the learner's probability of the risky first digit falls towards 0 within a few
dozen updates and it settles on the safe path, near 0.65, although its own completion of the risky path
would pay more (it ends at or below the policy frozen at onset). The control learns both the choice and the
completion. Token-level truncated IS (`token-tis`) leaves the first digit's weight at pi_old / mu = 1, the
token where the damage is done, and does not help; sequence-level truncated IS (`seq-tis`, the answer's
truncated product of ratios, cap 2) weighs the first digit by how likely the learner was to write the
continuation the sampler wrote, keeps the risky path and learns, though more slowly than the control (the cap
limits how much a completed continuation counts).

Return (the true one): the learner's exact expected post-onset reward on the 8 held-out prompts,
`heldout_reward` = sum over prompts of p5 c + (1 - p5) 0.65, with p5 the probability of the risky first digit
and c the probability that digits 2-6 avoid a and b after it, computed exactly by one forward over the tree
of allowed continuations (k ** 4 rows per prompt, k = 4 or 5 allowed digits; equal to enumerating all 6 ** 6
answers, checked in the tests). To keep a trial cheap it is evaluated every EVAL_EVERY = 3 iterations and at
the last one; the rows between hold NaN (the scorer's means skip them). Ground truth: `heldout_reward`, its
mean over the last 25% of the run below 0.70. Normalized return: `return_floor` is what the policy FROZEN AT
ONSET earns after onset, `return_ceiling` what the baseline's control reaches after onset, both averaged
over calibration seeds 0-9 at the quick budget, measured once and fixed.

Fix and non-fixes. Matched fix: `seq-tis`. Named non-fix: `token-tis` (the correction that fixes
rare-tool-states does not reach the first token's credit here). Detector: `engine_kl` (the batch's k1
estimate of KL(mu || pi_old) per token) above 0.1, verl's health warning, not tuned: it flags every injected
run, fixed or not, and never the control.

Settings and the seeds they were chosen on (prototype on the project's GRPO, then the module itself). The
recipe's setting (safe pay 0.75, temperature 3, lr 2e-3) on seeds 0-1 and design seeds 10-12: the baseline
failed but the fix recovered little of a thin span. Design seeds 10-12: lr 4e-3 with safe pay 0.65 widened
the span; temperature 2.5 let the baseline escape on one seed, lr 6e-3 made the fix fail; a warm-up of 300
steps (the warm policy completes the risky path almost always) left the baseline learning. Design seeds
13-22 on the module: temperature 3 let the baseline escape on some seeds and the fix fail on one; safe pay
0.7 made the fix fail on one; temperature 4 with safe pay 0.65 separated the arms on every one, and the 0.70
threshold was set between the baseline's tails and the fix's there, above every frozen policy's return seen
on seeds 10-12. Version 2 (lr 4e-3) was calibrated on seeds 0-9, where the fix fell below the threshold on
too many seeds (its return wobbles at that step size); version 3 lowers the step size to 3e-3, checked on
design seeds 23-32, and keeps every other setting. Seeds 100-109 were run once per version, after its
settings were frozen, and were not looked at before version 3's were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from stabench.baselines.tokens import lm_logits
from stabench.suite.api import (
    BEHAVIOUR_POLICY,
    Budget,
    DetectorSpec,
    Figure,
    GroundTruth,
    StabenchError,
    Stabilizer,
    Task,
    TrainState,
)
from stabench.tasks.worlds import digits
from stabench.tasks.worlds.digits import (
    HELDOUT_PROMPTS,
    N_ACTIONS,
    PROMPT_LEN,
    TRAIN_PROMPTS,
    WARMUP_BATCH,
    WARMUP_LR,
    WARMUP_SEED,
    correct,
    seeded,
)
from stabench.tasks.worlds.scaffold import GRPORun
from stabench.tasks.worlds.tokens import (
    PromptedAnswerEnv,
    RewardFn,
    WarmStart,
    answer_logits,
    tiny_policy,
)
from torch import nn

if TYPE_CHECKING:
    import pandas as pd

# --- The world: the digit world's prompts, 6-digit answers, a risky and a safe path. -----------------------
ANSWER_LEN = 6  # 6 ** 6 answers per prompt
RISKY = 5  # a first digit equal to this takes the risky path; any other first digit the safe one
SAFE_PAY = 0.65  # the safe path's flat payment (the risky path pays 1 or 0)
RISKY_SHARE = 0.5  # the warm-up forces the first digit to RISKY with this probability
WARMUP_STEPS = 100
TEMPERATURE = 4.0  # the injected sampler divides the learner's logits of digits 2-6 by this
EVAL_EVERY = 3  # the exact held-out evaluation runs every EVAL_EVERY iterations (and at the last one)
REWARD_FLOOR = 0.70  # ground truth: tail mean of the exact held-out reward below this fails

# --- The trainer: on-policy GRPO, one Adam step per batch, no KL term. ------------------------------------
LR = 3e-3
GRPO_CONFIG = replace(digits.GRPO_CONFIG, lr=LR, beta=0.0, epochs=1, minibatches=1, answer_len=ANSWER_LEN)
BUDGETS = {
    "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
    "quick": Budget(iterations=60, onset=3, seeds=5),
    "full": Budget(iterations=120, onset=5, seeds=10),
}


def old_rule(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The pre-onset rule: 1 if no answer digit equals either prompt digit (the digit world's `correct`)."""
    return correct(prompts, answers)


def risky_rule(prompts: torch.Tensor, answers: torch.Tensor, safe: float = SAFE_PAY) -> torch.Tensor:
    """The post-onset rule: a first digit RISKY pays 1 if digits 2-6 avoid a and b (else 0); any other first
    digit pays `safe`."""
    clean = correct(prompts, answers[:, 1:])
    return torch.where(answers[:, 0] == RISKY, clean, torch.full_like(clean, safe))


class _Logits:
    """What a causal LM's forward returns, as far as the token machinery reads it."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class ContinuationSampler(nn.Module):
    """The learner's weights served with a temperature on the continuation: the logits of answer digits 2-6
    are divided by `temperature`, the first digit's are the learner's own.

    Called like the policy (`sampler(input_ids=..., use_cache=False).logits`); the special token keeps a
    logit far below every answer token, so the sampler never emits it. It shares the learner's parameters
    (held in a list, so that they are not registered twice) and follows every update. Prompts are
    PROMPT_LEN tokens long, so position PROMPT_LEN - 1 predicts the first digit and later positions the rest.
    """

    def __init__(self, policy: nn.Module, temperature: float = TEMPERATURE) -> None:
        super().__init__()
        self._policy, self.temperature = [policy], temperature

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> _Logits:
        logits = lm_logits(self._policy[0], input_ids)[..., :N_ACTIONS]
        scale = torch.ones(logits.shape[-2], 1, dtype=logits.dtype)
        scale[PROMPT_LEN:] = 1 / self.temperature
        out = torch.full((*logits.shape[:-1], N_ACTIONS + 1), -1e4, dtype=logits.dtype)
        out[..., :N_ACTIONS] = logits * scale
        return _Logits(out)


# --- The environment. --------------------------------------------------------------------------------------
class InferenceMismatchEnv(PromptedAnswerEnv):
    """One episode: a training prompt (a, b), then an answer of ANSWER_LEN digits (observation: a, b, the answer
    so far). Reward at the last digit: the old rule before onset (`after_onset=False`), `risky_rule` after. The
    sampler mismatch is a property of who draws the actions, not of the environment."""

    def __init__(self, after_onset: bool = True, safe: float = SAFE_PAY) -> None:
        rule = (lambda p, a: risky_rule(p, a, safe)) if after_onset else old_rule
        super().__init__(rule, TRAIN_PROMPTS, N_ACTIONS, ANSWER_LEN)


# --- The warm start. ---------------------------------------------------------------------------------------
def _build() -> nn.Module:
    return tiny_policy(N_ACTIONS, PROMPT_LEN + ANSWER_LEN, **digits.MODEL)


def warm_up(share: float = RISKY_SHARE, steps: int = WARMUP_STEPS) -> nn.Module:
    """Supervised warm-up (the digit world's: Adam, WARMUP_BATCH answers a step, its own Generator): answers of
    uniformly drawn digits that avoid the prompt's a and b, the first digit then set to RISKY with probability
    `share`. The warm policy takes the risky path often and completes it well, but not always."""
    model = seeded(_build)
    rng = np.random.default_rng(WARMUP_SEED)
    allowed = [[d for d in range(N_ACTIONS) if d not in (int(p[1]), int(p[2]))] for p in TRAIN_PROMPTS]
    optimizer = torch.optim.Adam(model.parameters(), lr=WARMUP_LR)
    for _ in range(steps):
        which = rng.integers(len(TRAIN_PROMPTS), size=WARMUP_BATCH)
        picks = rng.integers(1 << 30, size=(WARMUP_BATCH, ANSWER_LEN))
        answers = torch.tensor([[allowed[i][k % len(allowed[i])] for k in row] for i, row in zip(which, picks)])
        answers[torch.from_numpy(rng.random(WARMUP_BATCH) < share), 0] = RISKY
        logits = answer_logits(model, TRAIN_PROMPTS[which], answers, N_ACTIONS)
        loss = nn.functional.cross_entropy(logits.reshape(-1, N_ACTIONS), answers.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def _warm_up() -> nn.Module:
    return warm_up()


# fixed per task version, shipped as tasks/warm_starts/inference-mismatch.safetensors (after changing the warm-up:
# stabench warm-start --retrain inference-mismatch)
warm_policy = WarmStart("inference-mismatch", _warm_up, _build,
                        sha256="bd2f51715e9dd676a3416be8bfb97bcd7fd5ea7be07ef6a3140be912486e2f7b")


# --- Exact evaluation on the held-out prompts: a tree walk over the risky path's allowed continuations. ----
# Rows [BOS, a, b, RISKY, c1..c4] for every held-out prompt and every c in its allowed digits ** 4.
TREE, SPANS, ALLOWED = digits.continuation_tree(
    HELDOUT_PROMPTS, [[d for d in range(N_ACTIONS) if d not in (int(p[1]), int(p[2]))] for p in HELDOUT_PROMPTS],
    RISKY, ANSWER_LEN,
)


STAT_KEYS = ("heldout_reward", "gt_risky_share", "gt_completion", "gt_engine_completion")


def heldout_stats_per_prompt(policy: nn.Module, temperature: float = TEMPERATURE,
                             safe: float = SAFE_PAY) -> list[dict[str, float]]:  # fmt: skip
    """Exact statistics of the learner (and of its continuation sampler at `temperature`) on each held-out prompt:
    the expected post-onset reward `heldout_reward` = p5 c + (1 - p5) safe, the risky first digit's probability
    p5 (`gt_risky_share`), the learner's risky-path completion c (`gt_completion`) and the sampler's
    (`gt_engine_completion`). One forward over `TREE`."""
    with torch.no_grad():
        logits = lm_logits(policy, TREE)[..., :N_ACTIONS].double()
    first = torch.softmax(logits[:, PROMPT_LEN - 1], -1)[:, RISKY]
    rest = logits[:, PROMPT_LEN:]
    own, engine = torch.log_softmax(rest, -1), torch.log_softmax(rest / temperature, -1)
    out = []
    for (s, e), ok in zip(SPANS, ALLOWED):
        p5, c = float(first[s]), digits.completion(own[s:e], ok)
        values = (p5 * c + (1 - p5) * safe, p5, c, digits.completion(engine[s:e], ok))
        out.append(dict(zip(STAT_KEYS, values)))
    return out


def heldout_stats(policy: nn.Module, temperature: float = TEMPERATURE, safe: float = SAFE_PAY) -> dict[str, float]:
    """`heldout_stats_per_prompt` averaged over the held-out prompts."""
    per_prompt = heldout_stats_per_prompt(policy, temperature, safe)
    return {k: float(np.mean([p[k] for p in per_prompt])) for k in STAT_KEYS}


# --- Knobs. ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """`InferenceMismatch(**knobs)`; the defaults are the registered task."""

    temperature: float = TEMPERATURE  # the injected sampler's temperature on digits 2-6
    safe: float = SAFE_PAY  # the safe path's payment

    def check(self, shortest_run: int) -> None:
        for name in ("temperature", "safe"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise StabenchError(f"inference-mismatch: {name} must be a positive number, got {value!r}")
        if self.safe >= 1:
            raise StabenchError(f"inference-mismatch: safe must be below the risky path's 1, got {self.safe!r}")


# --- One run. ----------------------------------------------------------------------------------------------
class InferenceMismatchRun(GRPORun):
    """One seed of GRPO on the 6-digit world; the sampler is rebuilt around the branch's own policy each step, so
    `copy.deepcopy` branches it with everything else."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 knobs: Knobs) -> None:  # fmt: skip
        # the reference is unused at beta 0; the trainer requires one
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=GRPO_CONFIG,
                         default_reward=old_rule, prompts=TRAIN_PROMPTS)  # fmt: skip
        self.temperature, self.safe = float(knobs.temperature), float(knobs.safe)

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        if not after_onset:
            return old_rule
        safe = self.safe
        return lambda prompts, answers: risky_rule(prompts, answers, safe)

    def sampler(self, injected: bool, after_onset: bool) -> nn.Module | None:
        """The injected branch samples from the continuation sampler from onset; otherwise the learner."""
        return ContinuationSampler(self.trainer.policy, self.temperature) if injected and after_onset else None

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        it = self.trainer.iteration  # iterations done, this one included
        evaluate = it % EVAL_EVERY == 0 or it >= self.budget.iterations
        stats = (self.evaluate(heldout_stats, self.trainer.policy, self.temperature, self.safe) if evaluate
                 else dict.fromkeys(STAT_KEYS, math.nan))  # fmt: skip
        return {
            "step": float(self.trainer.tokens),
            "return": stats["heldout_reward"],
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            **stats,
        }


# --- The figure. -------------------------------------------------------------------------------------------
def draw_engine_kl(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """The training-inference KL over training and against each run's normalized return."""
    from stabench.suite import figures

    rows = figures.need(table, "inference-mismatch", "engine_kl")
    return figures.gap_against_return(rows, "engine_kl", "training-inference KL E_mu[log mu - log pi_old]", out,
                                      name)  # fmt: skip


class InferenceMismatch(Task):
    """See the module docstring."""

    id = "inference-mismatch"
    family = "reasoning"
    version = "3"
    trainer = "grpo"
    experimental = False  # version 3: bar met on seeds 0-9 and the failure-rate checks on 100-109 (calibration.md)
    budgets = BUDGETS
    ground_truth = GroundTruth(metric="heldout_reward", threshold=REWARD_FLOOR, fails_when="below", reduce="tail_mean")
    matched_fix = "seq-tis"
    methods = ("baseline", "seq-tis", "token-tis")
    detector = DetectorSpec(metric="engine_kl", threshold=0.1, above=True)
    diagnostics = ("engine_gap", "grad_norms")
    privileged = STAT_KEYS
    provides = frozenset({BEHAVIOUR_POLICY})  # the sampler is not the learner (from onset, injected)
    # Floor: the policy frozen at onset, its exact post-onset return averaged over calibration seeds 0-9; ceiling:
    # the baseline's control's post-onset mean return on the same seeds. Both measured once and fixed (version 3).
    return_floor = 0.6792
    return_ceiling = 0.8745
    knobs_type = Knobs
    environments = {"stabench/InferenceMismatch-v0": "InferenceMismatchEnv"}
    figures = (
        Figure(
            "engine-kl",
            "training-inference KL against return",
            "inference-mismatch: the training-inference KL over training (left) and against each run's "
            "normalized return (right).",
            draw_engine_kl,
        ),
    )
    paper = """On inference-mismatch the answers come, from onset, from an inference sampler that writes the
later digits of an answer at a higher temperature than the learner, and GRPO trains on them as if the learner had drawn
them. The reward pays a risky first digit only if the continuation is right, and a safe first digit a flat
0.65. Because the sampler completes the risky path badly, the uncorrected learner credits the risky first
digit with the sampler's failures and abandons the path it could complete itself, ending near the safe
payment. Token-level truncated importance sampling leaves the first digit's weight at one and does not help;
sequence-level truncated importance sampling weighs the first digit by the whole continuation's ratio, keeps
the risky path and learns. The figure below shows the training-inference KL and the return of every run."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> InferenceMismatchRun:
        return InferenceMismatchRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs)
