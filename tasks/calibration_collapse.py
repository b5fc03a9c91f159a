"""calibration-collapse: the policy states a confidence after its answer; after onset its problems can only be
guessed, and under a binary correctness reward the stated confidence stays where the warm start left it, far
above the accuracy (seed 002, RLCR). A binary reward gives the confidence token no expected gradient (the
advantage depends on the answer only), so nothing moves it but noise and the KL term, which holds it at the warm
start's; a Brier term in the reward moves it down to the accuracy. `results/calibration.md` holds the measured
numbers.

The world is the digit world (`tasks.worlds.digits`) with one more token: a prompt is two digits (a, b) from
0-5, an answer is 3 digits then a confidence digit d (stated confidence d / 5), 216 x 6 sequences, all
enumerable. The policy is the same tiny GPT-2 (1 layer, 32 wide, from a config), warmed up by a supervised phase
on answers that avoid a and b (the old rule), each followed by a confidence digit drawn from `WARM_CONFIDENCE`
whatever the answer (mean 0.83: about right for a policy that writes valid answers). GRPO as the digit world's
(k3 KL to the warm start at beta 0.1, clip 0.2, 8 prompts x groups of 8, Adam 2e-3, 2 epochs per batch), with
answers of 4 tokens.

What must be learned after onset (both branches). Before onset the old rule pays (1 for an answer avoiding a and
b). From onset an answer must also avoid 5 (`correct_new`), which the warm start writes often: both branches
learn it.

The injection. From onset every problem of the injected branch has a hidden last digit: an answer is accepted
only if it is valid and its last digit equals a digit drawn uniformly, per answer, from {0..4} - {a, b}
(`guess_reward`). No policy can beat a guess there: a valid answer is accepted with probability 1/3 on the
held-out prompts (1/4 where a = b). Both branches keep a binary reward; the control's problems stay answerable.

Return and ground truth, exact by enumeration on the 8 held-out prompts: with p(x) the probability that answer x
is accepted in the branch's world, `heldout_brier` = sum_x pi(x) sum_c pi(c | x) (c / 5 - p(x))^2, the squared
gap between the stated confidence and the chance of being right (the Brier score less its irreducible part).
The return is 1 - `heldout_brier`. Ground truth: `heldout_brier`, its mean over the last 25% of the run above
0.25. A learner that does not learn fails: the warm start and the policies frozen at onset keep their confident
old-rule answers.

Fix and non-fixes. Matched fix: `brier-reward`, the reward R - (c - R)^2 (RLCR) in place of R in the
group-normalized advantages. Named non-fixes: `kl-anchor` (the pull to the confident warm start, stronger, which
also slows the new rule) and `entropy-bonus`.

The KL term matters: without it (beta 0) the confidence drifts by sampling noise alone, in both branches, and
the split between them is lost; the clean failure needs the trainer's KL to hold the confidence. This tiny policy
states one confidence per prompt, not per answer.

Settings and where they were chosen (prototype, seeds 0-3, then 0-9): the confidence after the answer (RLCR's
order; first, the exact evaluation costs 6 times more and the baseline's margin was thinner), every post-onset
problem guessable (a share of hard prompts left the Brier control unable to tell them apart: it raised its
confidence everywhere), the threshold 0.25 between the control's worst and the baseline's best. Two designs that
did not work: a confidence tied to the answer's validity in the warm start (the policy never learned to tell
valid from invalid, even 2 layers wide 64 or 1500 steps), and the Brier reward as the control (it is the fix,
bit for bit). Nothing was tuned on seeds 100-109 except the detector's threshold.

Detector: `confidence_gap_recent` (a batch's mean stated confidence less its mean reward, averaged over the last
10 iterations) above 0.4, chosen on seeds 100-109. It reads the overconfidence as soon as the problems turn into
guesses, so it also alarms on the fix's injected runs before the Brier reward brings their gap down.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from stabench.suite.api import POLICY_REUSE, Budget, DetectorSpec, Figure, GroundTruth, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import confidence_gap
from stabench.tasks.worlds.digits import (
    ALL_ANSWERS,
    BUDGETS,
    GRPO_CONFIG,
    HELDOUT_CORRECT,
    HELDOUT_OLD,
    HELDOUT_PROMPTS,
    MODEL,
    N_ACTIONS,
    PROMPT_LEN,
    TRAIN_PROMPTS,
    correct,
    correct_new,
    fit_old_rule,
    seeded,
)
from stabench.tasks.worlds.scaffold import GRPORun, Trailing
from stabench.tasks.worlds.tokens import PromptedAnswerEnv, RewardFn, WarmStart, answer_logits, tiny_policy
from torch import nn

if TYPE_CHECKING:
    import pandas as pd

DIGITS = 3  # the answer's digits; the confidence digit follows them
LENGTH = DIGITS + 1
GUESSABLE = 5  # the hidden digit is drawn from 0 .. GUESSABLE - 1, less the prompt's digits
WARM_CONFIDENCE = (0.02, 0.03, 0.05, 0.1, 0.3, 0.5)  # P(confidence digit d) in the warm-up data, d = 0..5
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 150, 256, 1e-2
CONFIG = replace(GRPO_CONFIG, answer_len=LENGTH)
BRIER_CEILING = 0.25  # ground truth: tail mean of heldout_brier above this fails
RECENT = 10  # confidence_gap_recent: the mean gap over the last RECENT iterations
CONFIDENCE_LEVELS = torch.arange(N_ACTIONS, dtype=torch.float64) / (N_ACTIONS - 1)


def stated_confidence(answers: torch.Tensor) -> torch.Tensor:
    """[B] the confidence an answer states: its last token d, as d / 5."""
    return answers[:, DIGITS].float() / (N_ACTIONS - 1)


def allowed_digits(prompts: torch.Tensor) -> torch.Tensor:
    """[B, GUESSABLE] bool: the digits a hidden digit may take, 0 .. GUESSABLE - 1 less the prompt's a and b."""
    digits = torch.arange(GUESSABLE)[None]
    return (digits != prompts[:, 1:2]) & (digits != prompts[:, 2:3])


def hidden_digits(prompts: torch.Tensor, draws: np.ndarray) -> torch.Tensor:
    """[B] one hidden digit per answer, uniform over the allowed digits, picked by the uniform draws `draws` [B]."""
    allowed = allowed_digits(prompts)
    k = (torch.as_tensor(draws) * allowed.sum(1)).long()  # the k-th allowed digit
    rank = allowed.long().cumsum(1) - 1
    return ((rank == k[:, None]) & allowed).long().argmax(1)


def guess_reward(prompts: torch.Tensor, answers: torch.Tensor, draws: np.ndarray) -> torch.Tensor:
    """The injected world: 1 if the answer's digits follow the new rule and its last digit is the hidden one."""
    valid = correct_new(prompts, answers[:, :DIGITS])
    return valid * (answers[:, DIGITS - 1] == hidden_digits(prompts, draws)).float()


WORLDS = ("old", "new", "guess")  # before onset; after onset in the control; after onset in the injected branch


def acceptance(world: str) -> torch.Tensor:
    """[8, 216] p(x): the probability that answer x is accepted on each held-out prompt, under the old rule, the
    new rule, or the new rule and a guess of 1 in |allowed| (`world`)."""
    if world not in WORLDS:
        raise ValueError(f"world must be one of {', '.join(WORLDS)}, got {world!r}")
    if world != "guess":
        return HELDOUT_OLD if world == "old" else HELDOUT_CORRECT
    return HELDOUT_CORRECT / allowed_digits(HELDOUT_PROMPTS).sum(1, keepdim=True).double()


# --- The warm start (also the frozen reference). ----------------------------------------------------------
def _build() -> nn.Module:
    return tiny_policy(N_ACTIONS, PROMPT_LEN + LENGTH, **MODEL)


def _with_confidence(answers: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Old-rule answers followed by a confidence digit drawn from WARM_CONFIDENCE."""
    weights = np.array(WARM_CONFIDENCE) / sum(WARM_CONFIDENCE)
    confidence = torch.from_numpy(rng.choice(N_ACTIONS, size=len(answers), p=weights))
    return torch.cat([answers, confidence[:, None]], 1)


def _warm_up() -> nn.Module:
    return fit_old_rule(seeded(_build), WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR, extend=_with_confidence)


# The tiny transformer after a supervised warm-up on old-rule answers followed by a confidence digit (shipped as
# tasks/warm_starts/calibration-collapse.safetensors; after changing the warm-up: stabench warm-start --retrain).
warm_policy = WarmStart("calibration-collapse", _warm_up, _build,
                        sha256="a33453e322bef076a4f184313a7d5ed2b897b9d28d321275120d1a13fab67277")


# --- Exact evaluation on the held-out prompts (one batched forward). --------------------------------------
def heldout_joint(model: nn.Module) -> torch.Tensor:
    """[8, 216, 6] pi(x, c) on every held-out prompt: every answer x (enumerate_answers order), then confidence c."""
    n_p, n_x = len(HELDOUT_PROMPTS), len(ALL_ANSWERS)
    sequences = torch.cat([ALL_ANSWERS, torch.zeros(n_x, 1, dtype=torch.long)], 1).repeat(n_p, 1)
    with torch.no_grad():
        logits = answer_logits(model, HELDOUT_PROMPTS.repeat_interleave(n_x, 0), sequences, N_ACTIONS)
    logp = torch.log_softmax(logits.double(), -1).view(n_p, n_x, LENGTH, N_ACTIONS)
    digits = ALL_ANSWERS[None, :, :, None].expand(n_p, -1, -1, 1)
    answer_logp = logp[:, :, :DIGITS].gather(-1, digits).squeeze(-1).sum(-1)  # [8, 216]
    return (answer_logp[..., None] + logp[:, :, DIGITS]).exp()


def calibration_stats(model: nn.Module, world: str) -> dict[str, float]:
    """Exact on the held-out prompts, in the branch's world (`WORLDS`): see `calibration_stats_of`."""
    return calibration_stats_of(heldout_joint(model), world)


def calibration_stats_of(joint: torch.Tensor, world: str) -> dict[str, float]:
    """From pi(x, c) [8, 216, 6]: `heldout_brier` (the ground truth), the expected calibration error over the 6
    confidence levels (`heldout_ece`), the mean stated confidence, the accuracy (the expected acceptance), and the
    share of answers valid under the new rule."""
    accept = acceptance(world)  # [8, 216]
    brier = (joint * (CONFIDENCE_LEVELS - accept[..., None]) ** 2).sum((1, 2))
    per_level = (joint * accept[..., None]).sum(1) - joint.sum(1) * CONFIDENCE_LEVELS  # [8, 6]
    pi_x = joint.sum(-1)
    return {
        "heldout_brier": float(brier.mean()),
        "heldout_ece": float(per_level.abs().sum(1).mean()),
        "heldout_confidence": float((joint * CONFIDENCE_LEVELS).sum((1, 2)).mean()),
        "heldout_accuracy": float((pi_x * accept).sum(1).mean()),
        "heldout_valid": float((pi_x * HELDOUT_CORRECT).sum(1).mean()),
    }


# --- The environment: one answer and its confidence. -------------------------------------------------------
class CalibrationCollapseEnv(PromptedAnswerEnv):
    """One episode: a training prompt (a, b), then 3 answer digits and a confidence digit (observation: a, b, the
    tokens so far). Reward at the last token: `correct` on the digits before onset; after onset `correct_new`, and
    in the injected world (`injected=True`) only if the last digit also equals a hidden digit."""

    def __init__(self, after_onset: bool = True, injected: bool = True) -> None:
        self.after_onset, self.injected = after_onset, injected
        super().__init__(self._reward, TRAIN_PROMPTS, N_ACTIONS, LENGTH)

    def _reward(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        if not self.after_onset:
            return correct(prompts, answers[:, :DIGITS])
        if not self.injected:
            return correct_new(prompts, answers[:, :DIGITS])
        return guess_reward(prompts, answers, self.np_random.random(len(answers)))


# --- One run. ----------------------------------------------------------------------------------------------
class CalibrationCollapseRun(GRPORun):
    """One seed of GRPO on the digit world with a confidence digit; the hidden-digit Generator and the confidence
    gaps live here too, so `copy.deepcopy` branches everything."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=CONFIG,
                         default_reward=correct, prompts=TRAIN_PROMPTS)  # fmt: skip
        self.hidden_rng = np.random.default_rng([seed, 2])
        self.gaps = Trailing(RECENT)
        self.world = "old"

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        cfg = self.trainer.config
        draws = self.hidden_rng.random(cfg.n_groups * cfg.group_size)
        self.world = ("guess" if injected else "new") if after_onset else "old"

        def reward(prompts: torch.Tensor, answers: torch.Tensor) -> dict[str, torch.Tensor]:
            if not after_onset:
                paid = correct(prompts, answers[:, :DIGITS])
            elif injected:
                paid = guess_reward(prompts, answers, draws)
            else:
                paid = correct_new(prompts, answers[:, :DIGITS])
            return {"reward": paid, "confidence": stated_confidence(answers)}

        return reward

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        gap = confidence_gap(state.batch["confidence"], state.batch["rewards"])
        self.gaps.push(gap["confidence_gap"])
        stats = calibration_stats_of(self.evaluate(heldout_joint, self.trainer.policy), self.world)
        return {
            "step": float(self.trainer.tokens),
            "return": 1.0 - stats["heldout_brier"],
            **stats,
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            "full_vocab_kl": float(state.extras["full_vocab_kl"].mean()),  # per token, pi || warm start
            **gap,
            "confidence_gap_recent": self.gaps.mean(),
        }


# --- The figure. -------------------------------------------------------------------------------------------
def draw_calibration(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Stated confidence beside the chance of being right: a binary reward leaves the confidence where it was."""
    from stabench.suite import figures

    panels = [("heldout_confidence", "mean stated confidence"),
              ("heldout_accuracy", "chance of being right (accuracy)"),
              ("heldout_brier", "Brier gap (ground truth)")]  # fmt: skip
    return figures.fix_against_baseline(table, "calibration-collapse", panels, out, name)


class CalibrationCollapse(Task):
    """See the module docstring."""

    id = "calibration-collapse"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    budgets = BUDGETS  # the digit world's schedule (quick: 50 iterations, onset 3)
    ground_truth = GroundTruth(metric="heldout_brier", threshold=BRIER_CEILING, fails_when="above", reduce="tail_mean")
    matched_fix = "brier-reward"
    methods = ("baseline", "brier-reward", "kl-anchor", "entropy-bonus")
    detector = DetectorSpec(metric="confidence_gap_recent", threshold=0.4, above=True)
    diagnostics = ("grad_norms",)  # confidence_gap is computed in the run: its recent mean reads its history
    privileged = ("heldout_brier", "heldout_ece", "heldout_confidence", "heldout_accuracy", "heldout_valid")
    provides = frozenset({"confidence", POLICY_REUSE})  # POLICY_REUSE: 2 epochs per batch (the digit config)
    return_floor = 0.3595  # frozen-at-onset's post-onset return in the injected world, mean of seeds 0-9
    return_ceiling = 0.8088  # the control's post-onset return, mean of seeds 0-9
    environments = {"stabench/CalibrationCollapse-v0": "CalibrationCollapseEnv"}
    figures = (
        Figure(
            "calibration",
            "stated confidence against accuracy",
            "calibration-collapse: the mean stated confidence, the chance of being right and the Brier gap between "
            "them (the ground truth), baseline and Brier reward, injected and control.",
            draw_calibration,
        ),
    )
    paper = """On calibration-collapse the policy states a confidence after each answer, and from onset its problems
can only be guessed (1 in 3 or 4). Under the binary reward the stated confidence stays at the warm start's
({tail:heldout_confidence:baseline}) while the chance of being right falls to {tail:heldout_accuracy:baseline}: the
confidence token gets no expected gradient from a reward that does not read it, and the KL term holds it where it
was. A Brier term in the reward (RLCR) brings it down to {tail:heldout_confidence:brier-reward} and fails
{failed:brier-reward} seeds; the KL anchor holds it harder and fails {failed:kl-anchor}, its control
{failed:kl-anchor:control}."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> CalibrationCollapseRun:
        return CalibrationCollapseRun(self.budget(tier), seed, stabilizer, self.diagnostics)
