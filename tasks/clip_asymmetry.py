"""clip-asymmetry: reusing each GRPO batch for many minibatch steps, with PPO's clip, while the new rule's answers
lie in the long tail of the vocabulary (DAPO's account of entropy collapse: the upper clip holds low-probability
tokens down while likely ones grow).

The world. A vocabulary of N_ACTIONS = 32 answer tokens; an answer is one token after the prompt BOS (every
answer is enumerable, so every statistic is exact). The warm start, built analytically from a seed and never
trained (`warm_policy`), is a tiny GPT-2 whose next-token distribution is Zipf's law, pi(v) proportional to
(v + 1) ** -ZIPF: a head of likely tokens and a long tail. Before onset the old rule pays a head token (ids below
TAIL_START); from onset the new rule (`correct_new`) pays the N_CORRECT tail tokens of CORRECT only, each near
1% at the warm start. Both branches must learn it.

The injection: off-policy reuse. The control and the healthy phase take one on-policy Adam step per batch (the
ratio is 1 and no clip binds); from onset the injected branch reuses each batch for REUSE_EPOCHS passes of
REUSE_MINIBATCHES minibatch steps, so the ratio leaves 1 and PPO's clip (0.2 / 0.2) binds. Trainer:
GRPO without a KL term (beta 0, as DAPO), 8 groups of 8, Adam lr 1e-2, token-mean aggregation.

Return (the true one): the expected share of a group of 8 samples that are distinct correct answers,
sum_{a in CORRECT} (1 - (1 - pi(a))^8) / 8, exact (pass@k-style coverage, as entropy-collapse's). It grows while
the policy learns the tail answers and falls when it collapses onto one of them. Ground truth:
`gt_expected_distinct` (8 x return), its mean over the last 25% of the run below DISTINCT_FLOOR.

Matched fix: `clip-higher` (DAPO's eps_high 0.28), which the field credits with keeping the entropy up in exactly
this regime; `clip-cov` and `kl-cov` (arXiv 2505.22617) are the field's other fixes for it. Whether they help here
was measured, not assumed: the task is experimental because the matched fix misses the bar (and on fresh seeds
the baseline's failure rate does too).

Mechanism, as measured (numbers in results/calibration.md): the clip binds in the reuse branch (its `clip_frac` is
far from 0 while the new rule is being learned) but it does not hold the tail down: the correct tail answers take
almost all the mass within a few iterations of onset, far faster than in the on-policy control. Once every answer
of a group is correct its advantages are 0, so the distribution freezes where the fast rise left it: most of the
mass on a few of the five answers, the entropy well below the control's. Widening the upper bound
(`clip-higher`) or restraining the high-covariance tokens (`clip-cov`, `kl-cov`) changes neither the rise nor the
freeze much: the collapse runs through the reuse's speed and GRPO's zero-advantage groups, not through the clip's
asymmetry.

Why an analytic warm start: the answer is one token after a fixed prompt, so the policy's distribution is the
logits at BOS; `warm_policy` sets the final layer norm to a constant (weight 0, bias e_0), so the hidden state at
BOS is e_0 whatever the body computes, and writes the Zipf logits into coordinate 0 of the (tied) output
embeddings of the answer tokens, which are never inputs here. Element-wise assignments only, so every machine
builds the same weights bit for bit and nothing ships as a file. Nothing is frozen: the layer norm's weight and
bias and the output embeddings train from the first step, the body once that weight has moved off 0.

Settings and where they were chosen: the vocabulary, the Zipf exponent, the correct set, the reuse schedule and the
learning rate in probes and a pilot on seeds 0-3; DISTINCT_FLOOR by its meaning (at least four of the five answers
kept), after that pilot and before the calibration seeds; floor and ceiling measured on seeds 0-9; the detector
threshold on seeds 100-109 only. Normalized return is a weak signal here: the reuse branch learns the rule in fewer
iterations than the control, so its post-onset mean return can exceed the ceiling even when it collapses; the
ground truth, read at the end, is what separates the two.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
from stabench.baselines.grpo import GRPOConfig
from stabench.suite.api import POLICY_REUSE, Budget, DetectorSpec, Figure, GroundTruth, Stabilizer, Task, TrainState
from stabench.suite.figures import lines, need
from stabench.tasks.worlds.scaffold import GRPORun, OnsetKnobs, Trailing
from stabench.tasks.worlds.tokens import AnswerEnv, RewardFn, answer_logits, tiny_policy
from torch import nn

# --- The world. -------------------------------------------------------------------------------------------
N_ACTIONS = 32  # answer tokens 0..31; id 32 is BOS
BOS = N_ACTIONS
ANSWER_LEN = 1
GROUP_SIZE = 8
ZIPF = 1.1  # the warm start's pi(v) is proportional to (v + 1) ** -ZIPF
TAIL_START = 16  # the tail: ids 16..31, each below 2% at the warm start
CORRECT = (18, 21, 24, 27, 30)  # the new rule's answers, all in the tail
N_CORRECT = len(CORRECT)
PROMPTS = torch.tensor([[BOS]])  # one prompt: the answer distribution is the policy's logits at BOS
MODEL = {"n_embd": 32, "n_layer": 1, "n_head": 2}
WARM_SEED = 0

# --- The trainer and the schedule. ------------------------------------------------------------------------
ON_POLICY = GRPOConfig(n_groups=8, group_size=GROUP_SIZE, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=1e-2,
                       beta=0.0, epochs=1, minibatches=1)
REUSE_EPOCHS, REUSE_MINIBATCHES = 4, 4  # the injection: 16 Adam steps per batch
REUSED = replace(ON_POLICY, epochs=REUSE_EPOCHS, minibatches=REUSE_MINIBATCHES)  # the injected branch's, from onset
BUDGETS = {
    "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
    "quick": Budget(iterations=40, onset=3, seeds=5),
    "full": Budget(iterations=80, onset=3, seeds=10),
}
DISTINCT_FLOOR = 3.0  # ground truth: fewer than 4 of the 5 correct answers kept (4 uniform: 3.60; 3 uniform: 2.88)
TREND_WINDOW = 10  # entropy_trend = entropy now minus entropy TREND_WINDOW iterations ago (or at the start)

_IS_CORRECT = torch.zeros(N_ACTIONS)
_IS_CORRECT[list(CORRECT)] = 1.0


# --- The rules: the environment and the trainer both call these. -------------------------------------------
def correct_old(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The healthy phase's rule: 1 for a head token (id below TAIL_START). answers [B, 1]."""
    return (answers[:, 0] < TAIL_START).float()


def correct_new(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The post-onset rule: 1 for a token of CORRECT (all in the tail). answers [B, 1]."""
    return _IS_CORRECT[answers[:, 0]]


class ClipAsymmetryEnv(AnswerEnv):
    """One answer token after BOS; `after_onset` picks the new rule (default) or the old one."""

    def __init__(self, after_onset: bool = True) -> None:
        super().__init__(correct_new if after_onset else correct_old, N_ACTIONS, ANSWER_LEN)


# --- The warm start (also the frozen reference, unused at beta 0). ----------------------------------------
def zipf_logits() -> list[float]:
    """-ZIPF log(v + 1) per answer token, centred (math.log: the same numbers on every machine)."""
    raw = [-ZIPF * math.log(v + 1) for v in range(N_ACTIONS)]
    mean = sum(raw) / N_ACTIONS
    return [z - mean for z in raw]


def warm_policy() -> nn.Module:
    """The tiny GPT-2 built under torch seed WARM_SEED (the caller's random state untouched), then made to write
    Zipf's law at BOS: final layer norm weight 0 and bias e_0, so the hidden state is e_0, and coordinate 0 of
    each answer token's (tied) embedding set to its Zipf logit."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WARM_SEED)
        model = tiny_policy(N_ACTIONS, PROMPTS.shape[1] + ANSWER_LEN, **MODEL)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[:N_ACTIONS, 0] = torch.tensor(zipf_logits())
    return model


# --- Exact statistics (one forward). ------------------------------------------------------------------------
def answer_logp(model: nn.Module) -> torch.Tensor:
    """log pi(v | BOS) for every answer token, [N_ACTIONS], in float64."""
    with torch.no_grad():
        logits = answer_logits(model, PROMPTS, torch.zeros(1, ANSWER_LEN, dtype=torch.long), N_ACTIONS)
    return torch.log_softmax(logits[0, 0].double(), -1)


def exact_stats(model: nn.Module) -> dict[str, float]:
    """Coverage as `return` (x GROUP_SIZE as `gt_expected_distinct`), the mass on the correct answers and on the
    tail, correct answers at or above 1%, and the exact entropy of the answer distribution."""
    logp = answer_logp(model)
    pi = logp.exp()
    correct = _IS_CORRECT.double()
    distinct = float((correct * (1 - (1 - pi) ** GROUP_SIZE)).sum())
    return {
        "return": distinct / GROUP_SIZE,
        "gt_expected_distinct": distinct,
        "correct_mass": float((pi * correct).sum()),
        "tail_mass": float(pi[TAIL_START:].sum()),
        "live_correct": float(((pi >= 0.01) & (correct > 0)).sum()),
        "policy_entropy": float(-(pi * logp).sum()),
    }


# --- One run. ----------------------------------------------------------------------------------------------
class ClipAsymmetryRun(GRPORun):
    """One seed: on-policy before onset and in the control, REUSE_EPOCHS x REUSE_MINIBATCHES steps per batch in the
    injected branch from onset. The entropy history lives here, so `copy.deepcopy` branches it with the trainer."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=ON_POLICY,
                         default_reward=correct_old, prompts=PROMPTS)  # fmt: skip
        self.entropy = Trailing(TREND_WINDOW)

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        return correct_new if after_onset else correct_old

    def step(self, injected: bool) -> dict[str, float]:
        reuse = injected and self.trainer.iteration >= self.budget.onset
        steps = REUSED if reuse else ON_POLICY
        self.trainer.config = replace(self.trainer.config, epochs=steps.epochs, minibatches=steps.minibatches)
        return super().step(injected)

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        entropy = self.entropy.push(state.extras["entropy"])
        return {
            "step": float(self.trainer.tokens),
            "entropy": entropy,
            "entropy_trend": self.entropy.change(),
            "reward": float(state.batch["rewards"].mean()),
            "clip_frac": float(state.losses.get("clip_frac", 0.0)),
            **self.evaluate(exact_stats, self.trainer.policy),
        }


def fig_entropy(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    rows = need(table, "clip-asymmetry", "entropy")
    return lines(rows, "entropy", "token entropy (nats)", out, name)


# --- The task. ---------------------------------------------------------------------------------------------
class ClipAsymmetry(Task):
    """See the module docstring."""

    id = "clip-asymmetry"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    provides = frozenset({POLICY_REUSE})  # the injected branch reuses each batch for 16 steps: the ratio leaves 1
    budgets = BUDGETS
    ground_truth = GroundTruth(
        metric="gt_expected_distinct", threshold=DISTINCT_FLOOR, fails_when="below", reduce="tail_mean"
    )
    matched_fix = "clip-higher"
    methods = ("baseline", "clip-higher", "clip-cov", "kl-cov")
    # Collapse under way: the batch token entropy below 1.2 nats (the control settles near log 5; seeds 100-109).
    detector = DetectorSpec(metric="entropy", threshold=1.2, above=False)
    diagnostics = ("grad_norms",)
    # exact over the vocabulary against the gold rule: what a practitioner cannot measure
    privileged = ("correct_mass", "live_correct", "tail_mass", "policy_entropy")
    return_floor = 0.0280  # the frozen-at-onset policy's post-onset return, mean of seeds 0-9 (exact per seed)
    return_ceiling = 0.2431  # the control's post-onset return, mean of seeds 0-9 (optimum 0.5201)
    experimental = True  # the matched fix misses the bar, and on seeds 100-109 the baseline too (calibration.md)
    knobs_type = OnsetKnobs
    environments = {"stabench/ClipAsymmetry-v0": "ClipAsymmetryEnv"}
    figures = (
        Figure("entropy", "token entropy under reuse",
               "Token entropy on clip-asymmetry, the injected baseline and clip-higher (the matched fix).",
               fig_entropy),
    )

    paper = """On clip-asymmetry a policy whose vocabulary has a long tail must learn a rule whose five answers all
start in that tail, and from onset the injected branch reuses each batch for sixteen minibatch steps under PPO's
clip, the regime in which DAPO reports entropy collapse from the upper clip holding low-probability tokens down. The
entropy does collapse: the reuse branch reaches the correct answers within a few iterations, then every group is
all correct, its advantages vanish, and the policy stays on a few of the five answers while the on-policy
control spreads over all of them. The clip binds but does not hold the tail down, and neither clip-higher nor
Clip-Cov nor KL-Cov prevents the collapse; the task stays experimental."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> ClipAsymmetryRun:
        return ClipAsymmetryRun(self.budget(tier), seed, stabilizer, self.diagnostics)
