"""inference-mismatch: from onset the answers come from an inference sampler that is a distorted copy of the
learner (a logit soft-cap), and GRPO forms its on-policy objective on them without correcting for mu != pi
(Zheng et al. 2025, seed 003). Measured: no failure at this scale. The uncorrected learner learns the new
rule like the control; the mismatch only sharpens it (lower entropy), which costs no expected reward here.

The world is entropy-collapse's (`tasks.entropy_collapse`): a prompt is two digits (a, b) from 0-5, an answer
3 digits (216 answers, all enumerable), the policy the same tiny GPT-2 warm start (1 layer, 32 wide, built
from a config). Before onset a correct answer avoids a and b; from onset it must also avoid 5 (`correct_new`),
which the warm start writes often: held-out accuracy 0.33-0.38 at onset. Both branches are paid the gold
verifier on every group, so both must learn the new rule; the control learns it (held-out accuracy 0.8-0.9).

The trainer. GRPO on-policy (one Adam step per batch, lr 2e-3, 8 prompts x groups of 8, no KL term: beta 0).
The learner recomputes pi_old and forms its term against it (`anchor_logp`), as a pipeline that recomputes
old log-probs does; the sampler's log-probs mu reach the hooks as `behaviour_logp` and the trainer never
reads them.

The injection. From onset the injected branch samples from `SoftCapSampler`: the learner's weights with a
logit soft-cap the learner lacks, z -> c tanh((z - max z) / c), c = 2 (an engine that caps logits, as some
kernels do). It fattens the sampler's tail, and the more the learner sharpens, the more the two differ: the
training-inference gap grows with learning. The control's sampler is the learner itself (bit-identical).

Return (the true one): the learner's exact expected reward on the 8 held-out prompts under the new rule,
sum_a pi(a) correct_new(a), by enumeration (`heldout_accuracy`).
- `return_floor`: the policy frozen at onset (`frozen-at-onset`), its post-onset return averaged over seeds 0-9.
- `return_ceiling`: the control's (baseline method, control branch) post-onset return averaged over seeds 0-9.
Ground truth: `heldout_accuracy`, its mean over the last 25% of the run below 0.6 (between the frozen policies,
0.33-0.38, and the control). Also exact per row: `gt_engine_kl`, the per-answer KL(mu || pi) over the held-out
prompts between the branch's sampler and the learner (0 when the learner samples).

Fix and non-fixes. Matched fix (the paper's): token-level truncated importance sampling against the
sampler's log-probs, sg[min(pi_old / mu, 2)] on each token's term (`token-tis`); also sequence-level
(`seq-tis`). Named non-fixes: PPO clipping against pi_old (`clip-higher`: on-policy its ratio is 1, so it never
binds) and an entropy bonus (`entropy-bonus`).

Mechanism, as measured: NONE at this scale. The uncorrected learner learns the new rule as well as the control
and as the corrected ones (numbers below), for every sampler distortion tried: logit soft-caps c = 1.5, 2, 3,
mixtures with the uniform distribution (1 - eps) pi + eps / 6 at eps 0.3, 0.5, 0.6, with learning rates 2e-3
to 6e-3, and a variant that paid partial credit for an abstain token only the sampler wrote (seeds 0-2 each).
What the mismatch does change is the one the paper reports first: the learner's entropy falls faster (tail
entropy 0.3-0.6 nats against the corrected runs' 0.6-0.8), because each tail token the sampler draws and the
learner almost never would is pushed down at full weight. Why that does not cost reward here: with a binary
reward every advantage has the right sign whoever sampled the answer, and in a softmax policy any positive
reweighting of right-signed per-answer updates still ascends the expected reward; the bias only sharpens the
learner. What the paper's collapse needs (a long answer whose credit depends on the sampler's continuation, a
large model whose logit error grows with training, graded rewards) is not present in 3-token answers. The
task stays experimental: it is the suite's measured statement that a training-inference mismatch of this kind
is benign for a small on-policy learner, and it carries the engine-gap diagnostics (`engine_gap`).

Numbers (quick tier: onset 3, 50 iterations; 10 seeds; normalized return with its 95% bootstrap interval;
tail = the last 25% of the run):
  seeds 0-9                  failed  control failed  normalized return    tail accuracy  tail entropy  engine KL
    baseline                 0/10    0/10            0.97 [0.92, 1.01]    0.89 (control 0.91)  0.44 (control 0.55)  0.97
    token-tis (fix)          0/10    0/10            0.97 [0.95, 0.99]    0.89           0.67          0.53
    seq-tis                  0/10    0/10            0.98 [0.96, 1.00]    0.89           0.74          0.47
    clip-higher              the baseline's rows bit for bit (on-policy the ratio is 1: the clip never binds)
    entropy-bonus            0/10    0/10            0.96 [0.92, 0.99]    0.89           0.61          0.77
    frozen-at-onset          10/10   10/10           0.00                 0.32
    no-update                10/10   10/10           0.02                 0.33
  seeds 100-109 (fresh): baseline 0/10 (tail accuracy 0.91, control 0.93), token-tis 0/10, references 10/10.
Engine KL is the batch's k1 estimate of KL(mu || pi_old) per token; the exact per-answer KL on the held-out
prompts is 2.9 nats for the baseline and 1.6 for token-tis (the learner that stays broader is nearer its
capped copy), and 10% of the baseline's sampled tokens have pi_old / mu below 1e-2 (token-tis: 1%). Over
200 iterations (prototype, seeds 0-2) the uncorrected learner's entropy reaches 0.00-0.04 and its accuracy
0.85-0.89 against the control's 0.95-0.99 and token-tis's 0.87-0.99: a slow drift, still no failure. A
quick-tier trial (healthy phase and both branches) takes 1.9 s on one shared core (median).
Detector: `engine_kl` above 0.1 (verl's health warning) fires at onset on every injected run and never on a
control; with no failing run it has nothing to predict here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from stabench.baselines.grpo import GRPO, GRPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.entropy_collapse import (
    ANSWER_LEN,
    HELDOUT_CORRECT,
    N_ACTIONS,
    TRAIN_PROMPTS,
    EntropyCollapse,
    correct,
    correct_new,
    heldout_logp,
    warm_policy,
)
from stabench.tasks.tokens import PromptedAnswerEnv
from torch import nn

# --- The trainer and the sampler. --------------------------------------------------------------------------
GRPO_CONFIG = GRPOConfig(
    n_groups=8, group_size=8, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=2e-3, beta=0.0, epochs=1,
    minibatches=1,
)  # fmt: skip
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
class InferenceMismatchRun:
    """One seed: the GRPO trainer (policy, Adam, sampling Generator) and the prompt Generator live here, so
    `copy.deepcopy` branches everything (the sampler is rebuilt around the branch's own policy each step)."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 cap: float) -> None:  # fmt: skip
        self.budget, self.diagnostics, self.cap = budget, diagnostics, cap
        reference = warm_policy().eval().requires_grad_(False)  # unused at beta 0; the trainer requires one
        self.trainer = GRPO(warm_policy().train(), reference, correct, replace(GRPO_CONFIG, seed=seed), stabilizer)
        self.prompt_rng = np.random.default_rng([seed, 1])

    def step(self, injected: bool) -> dict[str, float]:
        which = self.prompt_rng.integers(len(TRAIN_PROMPTS), size=self.trainer.config.n_groups)
        onset = self.trainer.iteration >= self.budget.onset
        sampler = SoftCapSampler(self.trainer.policy, self.cap) if injected and onset else None
        state = self.trainer.iterate(correct_new if onset else correct, TRAIN_PROMPTS[which], sampler=sampler)
        stats = heldout_stats(self.trainer.policy, sampler)
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": stats["heldout_accuracy"],
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            **stats,
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class InferenceMismatch(Task):
    """See the module docstring."""

    id = "inference-mismatch"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    experimental = True
    budgets = EntropyCollapse.budgets  # the same world on the same schedule (quick: 50 iterations, onset 3)
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

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> InferenceMismatchRun:
        return InferenceMismatchRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.cap)
