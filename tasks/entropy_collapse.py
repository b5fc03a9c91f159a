"""entropy-collapse: a majority vote on part of the batch (test-time-RL style) collapses GRPO's diversity while a
new rule is being learned, so the policy ends with few correct answers per prompt.

The world, the warm start (also the frozen reference), the trainer and the schedule are the digit world's
(`tasks.worlds.digits`): before onset the old rule pays (an answer avoiding a and b); from onset a correct answer
must also avoid 5 (`correct_new`), which both branches must learn. GRPO: k3 KL to the warm start at beta 0.1, PPO
clipping 0.2/0.2, 8 prompts x groups of 8, Adam lr 2e-3, 2 epochs per batch (so the ratio can leave 1). The
control is paid `correct_new` on every group.

The injection. From onset the injected branch keeps the gold verifier on `N_GOLD_GROUPS` = 3 of its 8 groups and
pays the other 5 by a majority vote as in test-time RL (`gold_and_vote`): 1 if the answer equals its group's most
frequent answer (every tied mode counts; a group of 8 distinct answers earns nothing); correctness is not
consulted. The vote is maximized only by one answer per prompt: it sharpens.

Return (the true one, never the vote): on the held-out prompts, exactly by enumeration, the expected number of
distinct new-rule-correct answers in a group of 8 samples divided by 8, sum_{a correct} (1 - (1 - pi(a))^8) / 8
(pass@k-style coverage, `digits.heldout_stats`). It grows when the policy learns the rule and falls when it
collapses. The ceiling is the control's post-onset return, not the exact optimum `coverage_optimum()` (uniform
over the correct answers): the post-onset mean includes the learning phase, and GRPO's own rich-get-richer
sharpening keeps every learner of this trainer far from the optimum.

Ground truth: `gt_expected_distinct` (8 x return: the expected number of distinct correct answers in a group of
8), its mean over the last 25% of the run below 3.2. A learner that does not learn fails it, and so does a
collapsed policy.

Mechanism: entropy collapse driven by the vote, which also stalls the learning: a group whose answers all agree
has zero advantage, so the gold groups cannot correct a collapsed prompt. Clip-higher (0.2/0.28) does not help:
the vote's mode is the answer with positive advantage, and loosening the upper clip only lets it grow as fast.
What holds diversity is a pull back towards the diverse warm start, the matched fix `kl-anchor` (0.3 x k3 beside
the trainer's beta); the entropy bonus (`entropy-bonus`, 0.05 x the exact per-token entropy) is the other named
non-fix.

Settings and where they were chosen: the new rule, beta 0.1 (with beta 0 the control's own sharpening left it
below the warm start's coverage), 3 gold groups of 8 (4 kept the injected collapse partial, 2 starved the fix of
learning), onset 3 (the old rule's healthy phase drifts the policy: a later onset widens the frozen policies'
spread) and the ground truth's 3.2 (between the frozen policies' best and the matched fix's worst) were chosen on
seeds 0-3 and the full calibration run on seeds 0-9; floor and ceiling were measured on seeds 0-9; nothing on
seeds 100-109 except the detector threshold. The full tier (100 iterations, onset 5) was not re-measured for this
version.

Diagnostic: `entropy_trend`, the batch token entropy minus its value `TREND_WINDOW` = 10 iterations before, below
-0.7 nats; the threshold was chosen on seeds 100-109 only (the best threshold-detector score among -0.4 ... -0.8
there). It sees the collapse, not a learner that stopped: the frozen and no-update references fail without any
entropy fall.

Predictions of the field tested here (paper/predictions.json, decided in the paper's fidelity table on the method
matrix), and why three of them mismatch:
- P02 ("clip-higher changes nothing where a batch is used for one update") reads "mismatch: effect": its interval
  lies inside the tolerance but excludes 0. The prediction's regime is one update per batch, and this task takes 2
  epochs per batch: in the second the ratio can pass 1.2, where clip-higher's bound is wider, and a small effect
  is what that leaves. The claim's algebra is not contradicted; the task is outside its regime.
- P03 and P04 (Clip-Cov and KL-Cov hold entropy above the baseline's) read "mismatch: no effect". At the authors'
  rates (`clip-cov` 2e-4, `kl-cov` 2e-3 of the tokens) an update on this task's 192 answer tokens (64 answers of
  3, one minibatch) yields less than one token, and the methods restrain one (at least one, as verl does:
  baselines/stabilizers/entropy.py), so each update they touch a single token, against a vote that sharpens every
  group it pays. Whether a larger share
  holds the entropy here was not run (`stabench tune` searches the share up to 0.1).

The measured numbers (failure rates, normalized returns, tails, the method matrix) are in `results/calibration.md`.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from stabench.suite.api import POLICY_REUSE, Budget, DetectorSpec, GroundTruth, Stabilizer, Task, TrainState
from stabench.tasks.worlds.digits import (
    ANSWER_LEN,
    BOS,
    BUDGETS,
    GROUP_SIZE,
    GRPO_CONFIG,
    N_ACTIONS,
    TRAIN_PROMPTS,
    correct,
    correct_new,
    heldout_stats,
    warm_policy,
)
from stabench.tasks.worlds.scaffold import GRPORun, OnsetKnobs, Trailing
from stabench.tasks.worlds.tokens import RewardFn

DISTINCT_FLOOR = 3.2  # ground truth: tail mean of the expected distinct correct answers in a group of 8
N_GOLD_GROUPS = 3  # injected branch: the first N_GOLD_GROUPS groups of a batch keep the gold verifier
TREND_WINDOW = 10  # entropy_trend = entropy now minus entropy TREND_WINDOW iterations ago (or at the start)


# --- Rewards: the environment and the trainer both call these. --------------------------------------------
def majority_vote(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Test-time-RL reward: 1 if the answer is a most frequent answer of its group of GROUP_SIZE (group members
    adjacent), provided that answer occurs at least twice; correctness is not consulted."""
    codes = (answers * torch.tensor([N_ACTIONS**2, N_ACTIONS, 1])).sum(1).view(-1, GROUP_SIZE)
    counts = (codes[:, :, None] == codes[:, None, :]).sum(-1)
    top = counts.max(1, keepdim=True).values
    return ((counts == top) & (top > 1)).float().reshape(-1)


def gold_and_vote(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The injected reward: `correct_new` on the first N_GOLD_GROUPS groups, `majority_vote` on the others."""
    split = N_GOLD_GROUPS * GROUP_SIZE
    vote = majority_vote(prompts, answers)
    gold = correct_new(prompts, answers)
    return torch.cat([gold[:split], vote[split:]])


# --- The environment. ---------------------------------------------------------------------------------------
class EntropyCollapseEnv(gym.Env):
    """One episode: a training prompt (a, b), then a group of GROUP_SIZE answers of ANSWER_LEN tokens.

    Observation: [a, b, the group's tokens so far padded with BOS]. Action: the next digit. Reward (the
    trainer's functions): before onset (`after_onset=False`) `correct` paid at the end of each answer; after
    onset the control's `correct_new` paid the same way, or with `injected=True` (a group the injected branch
    pays by vote) the group's summed `majority_vote` paid at the last token (the vote needs the group).
    """

    metadata = {"render_modes": []}

    def __init__(self, injected: bool = False, after_onset: bool = True) -> None:
        self.injected, self.after_onset = injected, after_onset
        size = 2 + GROUP_SIZE * ANSWER_LEN
        self.observation_space = gym.spaces.MultiDiscrete(np.full(size, N_ACTIONS + 1, dtype=np.int64))
        self.action_space = gym.spaces.Discrete(N_ACTIONS)
        self._prompt = TRAIN_PROMPTS[0]
        self._tokens: list[int] = []

    def _obs(self) -> np.ndarray:
        obs = np.full(self.observation_space.shape, BOS, dtype=np.int64)
        obs[:2] = self._prompt[1:].cpu().numpy()
        obs[2 : 2 + len(self._tokens)] = self._tokens
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._prompt = TRAIN_PROMPTS[int(self.np_random.integers(len(TRAIN_PROMPTS)))]
        self._tokens = []
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not a digit in 0..{N_ACTIONS - 1}")
        if len(self._tokens) >= GROUP_SIZE * ANSWER_LEN:
            raise RuntimeError("the group is complete; call reset()")
        self._tokens.append(int(action))
        n = len(self._tokens)
        done = n == GROUP_SIZE * ANSWER_LEN
        reward = 0.0
        if n % ANSWER_LEN == 0:
            answers = torch.tensor(self._tokens, dtype=torch.long).view(-1, ANSWER_LEN)
            prompts = self._prompt[None].expand(len(answers), -1)
            if not self.injected or not self.after_onset:
                rule = correct_new if self.after_onset else correct
                reward = float(rule(prompts[-1:], answers[-1:])[0])
            elif done:
                reward = float(majority_vote(prompts, answers).sum())
        return self._obs(), reward, done, False, {}


# --- One run. ----------------------------------------------------------------------------------------------
class EntropyCollapseRun(GRPORun):
    """One seed of the digit world's GRPO run; the entropy history lives here too, so `copy.deepcopy` branches
    it with the trainer."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        super().__init__(budget, seed, stabilizer, diagnostics, warm=warm_policy, config=GRPO_CONFIG,
                         default_reward=correct, prompts=TRAIN_PROMPTS)  # fmt: skip
        self.entropy = Trailing(TREND_WINDOW)

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        return (gold_and_vote if injected else correct_new) if after_onset else correct

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        entropy = self.entropy.push(state.extras["entropy"])
        batch = state.batch
        return {
            "step": float(self.trainer.tokens),
            "entropy": entropy,
            "entropy_trend": self.entropy.change(),
            "reward": float(batch["rewards"].mean()),
            "train_accuracy": float(correct_new(batch["prompts"], batch["answers"]).mean()),
            **heldout_stats(self.trainer.policy),
        }


# --- The task. ---------------------------------------------------------------------------------------------
class EntropyCollapse(Task):
    """See the module docstring."""

    id = "entropy-collapse"
    family = "reasoning"
    version = "2"
    trainer = "grpo"
    provides = frozenset({POLICY_REUSE})  # 2 epochs per batch (digits.GRPO_CONFIG): the ratio leaves 1
    budgets = BUDGETS
    ground_truth = GroundTruth(
        metric="gt_expected_distinct", threshold=DISTINCT_FLOOR, fails_when="below", reduce="tail_mean"
    )
    matched_fix = "kl-anchor"
    methods = ("baseline", "kl-anchor", "clip-higher", "entropy-bonus")
    # Collapse under way: token entropy down 0.7 nats (of ~1.45 at onset) within 10 iterations (seeds 100-109).
    detector = DetectorSpec(metric="entropy_trend", threshold=-0.7, above=False)
    diagnostics = ("grad_norms",)
    # exact by enumeration over held-out prompts, or gold on the batch that the vote-paid groups never see
    privileged = ("heldout_accuracy", "heldout_seq_entropy", "live_correct", "old_rule_accuracy", "train_accuracy")
    return_floor = 0.2904  # the frozen-at-onset policy's post-onset return, mean of seeds 0-9 (exact per seed)
    return_ceiling = 0.5132  # the control's post-onset return, mean of seeds 0-9 (coverage_optimum() is 0.8964)
    knobs_type = OnsetKnobs
    environments = {"stabench/EntropyCollapse-v0": "EntropyCollapseEnv"}
    paper = """On entropy-collapse a majority vote, as in test-time RL, pays five of the eight groups of each
injected batch while the policy must learn a new rule; the vote is maximized by one answer per prompt, so it
sharpens the policy until few correct answers per prompt remain. DAPO's clip-higher does not hold diversity, since
a looser upper clip only lets the vote's mode grow as fast, while a KL anchor to the diverse warm start does. The
entropy bonus (0.05 times the exact entropy) raises the return but does not prevent the collapse."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> EntropyCollapseRun:
        return EntropyCollapseRun(self.budget(tier), seed, stabilizer, self.diagnostics)
