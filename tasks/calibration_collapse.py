"""calibration-collapse: the policy states a confidence after its answer; after onset its problems can only be
guessed, and under a binary correctness reward the stated confidence stays where the warm start left it, far
above the accuracy (seed 002, RLCR). Measured: a binary reward gives the confidence token no expected gradient
(the advantage depends on the answer only), so nothing moves it but noise and the KL term, which holds it at the
warm start's; a Brier term in the reward moves it down to the accuracy.

The world is entropy-collapse's (`tasks.entropy_collapse`) with one more token: a prompt is two digits (a, b)
from 0-5, an answer is 3 digits then a confidence digit d (stated confidence d / 5), 216 x 6 sequences, all
enumerable. The policy is the same tiny GPT-2 (1 layer, 32 wide, from a config), warmed up by a supervised phase
on answers that avoid a and b (the old rule), each followed by a confidence digit drawn from `WARM_CONFIDENCE`
whatever the answer (mean 0.83: about right for a policy that writes valid answers). GRPO as entropy-collapse's
(k3 KL to the warm start at beta 0.1, clip 0.2, 8 prompts x groups of 8, Adam 2e-3, 2 epochs per batch), with
answers of 4 tokens.

What must be learned after onset (both branches). Before onset the old rule pays (1 for an answer avoiding a and
b). From onset an answer must also avoid 5 (`correct_new`), which the warm start writes often: both branches
learn it (the share of valid answers goes from 0.28 at onset to 0.9 in the control).

The injection. From onset every problem of the injected branch has a hidden last digit: an answer is accepted
only if it is valid and its last digit equals a digit drawn uniformly, per answer, from {0..4} - {a, b}
(`guess_reward`). No policy can beat a guess there: a valid answer is accepted with probability 1/3 on the
held-out prompts (1/4 where a = b). Both branches keep a binary reward; the control's problems stay answerable.

Return and ground truth, exact by enumeration on the 8 held-out prompts: with p(x) the probability that answer x
is accepted in the branch's world, `heldout_brier` = sum_x pi(x) sum_c pi(c | x) (c / 5 - p(x))^2, the squared
gap between the stated confidence and the chance of being right (the Brier score less its irreducible part).
The return is 1 - `heldout_brier`. Ground truth: `heldout_brier`, its mean over the last 25% of the run above
0.25. A learner that does not learn fails: the warm start (`no-update`) and the policies frozen at onset keep
their confident old-rule answers (0.5-0.7 in the injected world).
- `return_floor`: the policy frozen at onset, its post-onset return in the injected world, mean of seeds 0-9.
- `return_ceiling`: the control's (baseline method, control branch) post-onset return, mean of seeds 0-9.

Fix and non-fixes. Matched fix: `brier-reward`, the reward R - (c - R)^2 (RLCR) in place of R in the
group-normalized advantages. Named non-fixes: `kl-anchor` (the pull to the confident warm start, stronger) and
`entropy-bonus`.

Mechanism, as measured (seeds 0-9, tail = the last 25% of the run): the stated confidence never leaves the warm
start's. The baseline's mean stated confidence is 0.81-0.89 in its injected runs and 0.81-0.91 in its controls,
whose chances of being right are 0.18-0.23 and 0.88-0.92; its covariance with the reward across a batch's answers
is 0.00 in every run (this tiny policy states one confidence per prompt, not per answer: in the prototype the
confidence on valid and on invalid answers was 0.855 and 0.854). A binary reward gives the confidence token no
expected gradient, and the KL term holds it at the warm start. Under the Brier reward it falls to 0.36-0.46
against accuracy 0.16-0.22 (and rises to 0.99 in the fix's control, whose accuracy is 0.89). At beta 0 (no KL
term; prototype, 5 seeds) the confidence drifts by sampling noise alone, in both branches, and the split is lost
(baseline 3/5, control 1/5 fail): the clean failure needs the trainer's KL to hold it. The KL anchor (0.3 more)
holds it harder and also slows the new rule, so even its control fails (Brier 0.28-0.32).

Settings and where they were chosen (prototype, seeds 0-3, then 0-9): the confidence after the answer (RLCR's
order; first, the exact evaluation costs 6 times more and the baseline's margin was thinner), every post-onset
problem guessable (a share of hard prompts left the Brier control unable to tell them apart: it raised its
confidence everywhere, to 0.97), the threshold 0.25 between the control's worst (0.16) and the baseline's best
(0.41). Two designs that did not work: a confidence tied to the answer's validity in the warm start (the policy
never learned to tell valid from invalid, 0.45 on both, even 2 layers wide 64 or 1500 steps), and the Brier
reward as the control (it is the fix, bit for bit). Nothing was tuned on seeds 100-109 except the detector's
threshold.

Numbers (quick tier: onset 3, 50 iterations; 10 seeds; normalized return with its 95% bootstrap interval;
tail = heldout_brier over the last 25% of the run):
  seeds 0-9                  failed  control failed  normalized return    tail Brier gap (per seed)
    baseline                 10/10   0/10            0.39 [0.36, 0.42]    0.42-0.56 (control 0.11-0.16)
    brier-reward (fix)        0/10   0/10            0.91 [0.88, 0.94]    0.10-0.14
    entropy-bonus            10/10   0/10            0.46 [0.43, 0.49]    0.35-0.47
    kl-anchor                10/10   10/10           0.16 [0.15, 0.17]    0.54-0.59
    frozen-at-onset          10/10   10/10           0.00                 0.52-0.70
    no-update                10/10   10/10           -0.01                0.64
  seeds 100-109 (fresh)
    baseline                 10/10   0/10            0.38 [0.33, 0.43]    0.36-0.50
    brier-reward (fix)        0/10   0/10            0.89 [0.86, 0.92]    0.11-0.14
    entropy-bonus, kl-anchor 10/10   0/10, 10/10     0.46, 0.16
    references               10/10   10/10           at most -0.01
A quick-tier trial (healthy phase and both branches) takes about 10 s (median) with two trials and another
job sharing the 2 cores; one branch of 47 iterations takes 2.2 s alone.
Detector: `confidence_gap_recent` (a batch's mean stated confidence less its mean reward, averaged over the last
10 iterations) above 0.4, chosen on seeds 100-109: the baseline's controls stay at or below 0.32, its injected
runs pass 0.4 2-6 iterations after onset. It reads the overconfidence as soon as the problems turn into guesses,
so it also alarms on the fix's injected runs (their gap passes 0.6 before the Brier reward brings it to 0.2-0.4).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from stabench.baselines.grpo import GRPO
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS, confidence_gap
from stabench.tasks.entropy_collapse import (
    ALL_ANSWERS,
    GRPO_CONFIG,
    HELDOUT_CORRECT,
    HELDOUT_OLD,
    HELDOUT_PROMPTS,
    MODEL,
    N_ACTIONS,
    PROMPT_LEN,
    TRAIN_PROMPTS,
    EntropyCollapse,
    correct,
    correct_new,
)
from stabench.tasks.tokens import PromptedAnswerEnv, answer_logits, tiny_policy, warm_start
from torch import nn

DIGITS = 3  # the answer's digits; the confidence digit follows them
LENGTH = DIGITS + 1
GUESSABLE = 5  # the hidden digit is drawn from 0 .. GUESSABLE - 1, less the prompt's digits
WARM_CONFIDENCE = (0.02, 0.03, 0.05, 0.1, 0.3, 0.5)  # P(confidence digit d) in the warm-up data, d = 0..5
WARMUP_SEED, WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 0, 150, 256, 1e-2
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
_WARM_STATE: dict[str, torch.Tensor] = {}


def warm_policy() -> nn.Module:
    """The tiny transformer after a supervised warm-up on old-rule answers followed by a confidence digit."""
    if not _WARM_STATE:
        _WARM_STATE.update(warm_start("calibration-collapse", _warm_up, __file__))
    with torch.random.fork_rng():
        model = tiny_policy(N_ACTIONS, PROMPT_LEN + LENGTH, **MODEL)
    model.load_state_dict(_WARM_STATE)
    return model


def _warm_up() -> nn.Module:
    rng = np.random.default_rng(WARMUP_SEED)
    with torch.random.fork_rng():
        torch.manual_seed(WARMUP_SEED)
        model = tiny_policy(N_ACTIONS, PROMPT_LEN + LENGTH, **MODEL)
    good = [ALL_ANSWERS[correct(p[None].expand(len(ALL_ANSWERS), -1), ALL_ANSWERS).bool()] for p in TRAIN_PROMPTS]
    weights = np.array(WARM_CONFIDENCE) / sum(WARM_CONFIDENCE)
    optimizer = torch.optim.Adam(model.parameters(), lr=WARMUP_LR)
    for _ in range(WARMUP_STEPS):
        which = rng.integers(len(TRAIN_PROMPTS), size=WARMUP_BATCH)
        answers = torch.stack([good[i][rng.integers(len(good[i]))] for i in which])
        confidence = torch.from_numpy(rng.choice(N_ACTIONS, size=WARMUP_BATCH, p=weights))
        sequences = torch.cat([answers, confidence[:, None]], 1)
        logits = answer_logits(model, TRAIN_PROMPTS[which], sequences, N_ACTIONS)
        loss = nn.functional.cross_entropy(logits.reshape(-1, N_ACTIONS), sequences.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


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
class CalibrationCollapseRun:
    """One seed: the GRPO trainer and the prompt and hidden-digit Generators live here, so `copy.deepcopy`
    branches everything."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        self.budget, self.diagnostics = budget, diagnostics
        reference = warm_policy().eval().requires_grad_(False)
        self.trainer = GRPO(warm_policy().train(), reference, correct, replace(CONFIG, seed=seed), stabilizer)
        self.prompt_rng = np.random.default_rng([seed, 1])
        self.hidden_rng = np.random.default_rng([seed, 2])
        self.gaps: list[float] = []

    def step(self, injected: bool) -> dict[str, float]:
        cfg = self.trainer.config
        which = self.prompt_rng.integers(len(TRAIN_PROMPTS), size=cfg.n_groups)
        draws = self.hidden_rng.random(cfg.n_groups * cfg.group_size)
        onset = self.trainer.iteration >= self.budget.onset

        def reward(prompts: torch.Tensor, answers: torch.Tensor) -> dict[str, torch.Tensor]:
            if not onset:
                paid = correct(prompts, answers[:, :DIGITS])
            elif injected:
                paid = guess_reward(prompts, answers, draws)
            else:
                paid = correct_new(prompts, answers[:, :DIGITS])
            return {"reward": paid, "confidence": stated_confidence(answers)}

        state = self.trainer.iterate(reward, TRAIN_PROMPTS[which])
        gap = confidence_gap(state.batch["confidence"], state.batch["rewards"])
        self.gaps.append(gap["confidence_gap"])
        stats = calibration_stats(self.trainer.policy, ("guess" if injected else "new") if onset else "old")
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": 1.0 - stats["heldout_brier"],
            **stats,
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            "full_vocab_kl": float(state.extras["full_vocab_kl"].mean()),  # per token, pi || warm start
            **gap,
            "confidence_gap_recent": float(np.mean(self.gaps[-RECENT:])),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class CalibrationCollapse(Task):
    """See the module docstring."""

    id = "calibration-collapse"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    budgets = EntropyCollapse.budgets  # the same world on the same schedule (quick: 50 iterations, onset 3)
    ground_truth = GroundTruth(metric="heldout_brier", threshold=BRIER_CEILING, fails_when="above", reduce="tail_mean")
    matched_fix = "brier-reward"
    methods = ("baseline", "brier-reward", "kl-anchor", "entropy-bonus")
    detector = DetectorSpec(metric="confidence_gap_recent", threshold=0.4, above=True)
    diagnostics = ("grad_norms",)  # confidence_gap is computed in the run: its recent mean reads its history
    privileged = ("heldout_brier", "heldout_ece", "heldout_confidence", "heldout_accuracy", "heldout_valid")
    provides = frozenset({"confidence"})
    return_floor = 0.3595  # frozen-at-onset's post-onset return in the injected world, mean of seeds 0-9
    return_ceiling = 0.8088  # the control's post-onset return, mean of seeds 0-9

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> CalibrationCollapseRun:
        return CalibrationCollapseRun(self.budget(tier), seed, stabilizer, self.diagnostics)
