"""kl-estimator-bias: GRPO's k3-in-the-loss regularizer bounds the wrong divergence (Shah et al. 2025).

The world. A tiny GPT-2 policy (1 layer, 32 wide, built from a config) writes answers of 4 tokens from a
vocabulary of 6; all 6**4 = 1,296 answers can be enumerated, so the exact sequence-level KL(pi || ref) and
the exact regularized objective are computed every iteration (one batched forward). The frozen reference
is the same transformer after a short supervised warm-up on answers sampled from a fixed Markov table
(smooth seeded logits over tokens 0-4 conditioned on position and previous token, +1 for repeating the
previous token, the rare token 5 at probability 0.003 everywhere); the policy starts as a copy of the
reference. GRPO: 16 groups of 8 answers, advantages R - group mean (Dr. GRPO: no division by the group
std, so the reward's scale meets beta as it does in the objective), Adam lr 1e-2, one update per batch,
token-mean losses, beta = 0.5 times k3 = exp(d) - 1 - d, d = log ref - log pi, in the loss (as in TRL).

The phases. Healthy (before onset): reward 1 if the first token is 0. From onset the goal moves in BOTH
branches: 8 for answers that start with 0 then 4, which the reference and the onset policy rarely write. Its
reverse-KL-regularized optimum pi* ∝ ref exp(R / beta) puts almost all its mass on the goal and is worth far
more than the policy frozen at onset or the reference: learning is required. The injection: the injected
branch is ALSO paid 4 times the share of positions 2-3 that hold the rare token (2 per position). The
regularized optimum wants little of it: it multiplies the reference's rare-token probability by exp(2 / beta)
= 55 (to about 0.14) and gains little.

The mechanism (on one token position, tests/test_token_family.py checks it exactly): on-policy, the
expected gradient of k3 in the loss is that of the FORWARD KL(ref || pi): its pull on an over-weighted
token p is beta (p - ref), bounded, while the reward pushes with r p (1 - p); with r = 2 > beta the
rare token settles near 1 - beta / r = 3/4 instead of 0.14. max(k2, k3) in the loss (k2 = the exact
per-token reverse-KL gradient where the policy over-weights) holds it near the optimum; k2 everywhere and
k1 in the reward (the unbiased sequence-level reverse-KL gradient) too. The logged k3 VALUE tracks the
exact KL: only its gradient is wrong, so the failure shows in any KL estimate.

Return: the exact regularized objective E_pi[R] - beta KL(pi || ref) under the branch's current reward
(control: the goal; injected: the goal plus the rare-token term), by enumeration. Normalized return 1 is
the exact optimum under the injected reward, beta log E_ref[exp(R / beta)] (`goal_ceiling()`, a test checks
the constant); 0 is the policy frozen at onset: its exact objective under the injected reward, averaged
over the frozen-at-onset runs of seeds 0-9 at the quick tier, measured once and fixed.

Ground truth: the exact regularized objective (column `gt_regularized`, the same number as the return)
averaged over the last quarter of the run falls below 5.3, which neither the reference nor the onset policy
can reach; set (version 3) between the baseline's and the fix's tails on seeds 0-2 and design seeds 10-29, where
every control also stays above it.

Detector: a KL budget on the logged k1, per-token mean above 1.5 (6 nats per answer; the optimum needs
less), chosen on the seeds 100-109 runs only; the detection window, 0.75 of the post-onset horizon, from
the seeds 0-9 crossings.

Settings and where they were chosen: goal (0, 4), goal reward 8, lr 1e-2, Dr. GRPO advantages, 120 iterations
with onset 20, on design runs of seeds 0-1. Tried there: GRPO's std-normalized advantages (the learner does not
see the reward's scale and the goal stalls), a goal reward of 4 (k3 and max(k2, k3) then settle alike) and lr
3e-3 (the rare token grows too slowly to fail within the run). Version 2 paid a rare reward of 3: on further
seeds (200-209, 300-309) its baseline's failure was thin, because the runaway starts when the rare token is first
sampled (about once an iteration at 0.003) and on slow seeds it had not settled by the tail. Version 3 pays 4 (a
stronger pull toward the token the reference rarely writes, so the runaway settles within the run), chosen on those
slow seeds (203, 300-302, 306) and design seeds 10-29; the threshold moved with it (above). The measured numbers
(failure rates, normalized returns and the estimators' traces on seeds 0-9 and 100-109) are in
results/calibration.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
from stabench.baselines.grpo import GRPOConfig
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, Stabilizer, Task, TrainState
from stabench.suite.figures import need, onset_line, save
from stabench.tasks.worlds.scaffold import GRPORun
from stabench.tasks.worlds.tokens import (
    AnswerEnv,
    RewardFn,
    WarmStart,
    all_answers_logp,
    answer_logits,
    enumerate_answers,
    on_default_device,
    prefix_logp,
    tiny_policy,
)
from torch import nn

# --- The world: 6 answer tokens, answers of 4 tokens (6**4 = 1,296 answers, all enumerable). -------------
N_ACTIONS = 6
ANSWER_LEN = 4
RARE = 5  # the token the reference almost never writes
RARE_PROB = 0.003
TABLE_SEED = 0  # the reference Markov table and its warm-up data are fixed per task version
TABLE_SCALE = 0.5  # std of the table's random logits over tokens 0-4
REPEAT_BONUS = 1.0  # logit bonus for repeating the previous token

# --- The policy and the trainer. ---------------------------------------------------------------------------
MODEL = {"n_embd": 32, "n_layer": 1, "n_head": 2}
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 300, 256, 1e-2
BETA = 0.5
GRPO_CONFIG = GRPOConfig(
    n_groups=16, group_size=8, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=1e-2, beta=BETA, std_normalize=False
)


# --- Rewards: the environment and the trainer both call these. --------------------------------------------
GOAL = (0, 4)  # post-onset target: answers that start with 0 then 4 (rare under the reference)
GOAL_REWARD = 8.0  # paid for the target; large against beta, so the regularized optimum moves far from the onset policy
RARE_POSITIONS = slice(2, 4)  # the injected pull: the rare token at positions 2-3
RARE_REWARD = 4.0  # paid times the share of those positions holding the rare token


def first_token_zero(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Healthy phase: 1 if the answer starts with token 0."""
    return (answers[:, 0] == 0).float()


def goal_prefix(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """From onset, both branches (the moved goal): GOAL_REWARD if the answer starts with GOAL."""
    hit = (answers[:, 0] == GOAL[0]) & (answers[:, 1] == GOAL[1])
    return GOAL_REWARD * hit.float()


def goal_and_rare(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """From onset, injected branch: the goal plus RARE_REWARD times the share of positions 2-3 holding token 5."""
    return goal_prefix(prompts, answers) + RARE_REWARD * (answers[:, RARE_POSITIONS] == RARE).float().mean(1)


class KLTokensEnv(AnswerEnv):
    """The task as a gymnasium environment: write 4 tokens; `post_onset` and `injected` pick the reward."""

    def __init__(self, injected: bool = False, post_onset: bool = True) -> None:
        reward = (goal_and_rare if injected else goal_prefix) if post_onset else first_token_zero
        super().__init__(reward, N_ACTIONS, ANSWER_LEN)


# --- The reference: a Markov table, then a tiny transformer warmed up on samples of it. ------------------
def reference_table() -> np.ndarray:
    """P[position, previous token, next token], [ANSWER_LEN, N_ACTIONS + 1, N_ACTIONS]; previous = N_ACTIONS is BOS.

    Smooth seeded logits over tokens 0-4 plus a bonus for repeating the previous token; the rare token has
    probability RARE_PROB everywhere.
    """
    rng = np.random.default_rng(TABLE_SEED)
    logits = TABLE_SCALE * rng.standard_normal((ANSWER_LEN, N_ACTIONS + 1, RARE))
    for prev in range(RARE):
        logits[:, prev, prev] += REPEAT_BONUS
    common = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return np.concatenate([(1 - RARE_PROB) * common, np.full((ANSWER_LEN, N_ACTIONS + 1, 1), RARE_PROB)], -1)


def sample_table(table: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n answers sampled from the Markov table: int array [n, ANSWER_LEN]."""
    out = np.empty((n, ANSWER_LEN), dtype=np.int64)
    prev = np.full(n, N_ACTIONS)
    for t in range(ANSWER_LEN):
        cdf = table[t, prev].cumsum(-1)
        out[:, t] = np.minimum((cdf < rng.random((n, 1)) * cdf[:, -1:]).sum(-1), N_ACTIONS - 1)
        prev = out[:, t]
    return out


def _warm_up_reference() -> nn.Module:
    """The reference's supervised warm-up on table samples. Deterministic: its own seeds, and `WarmStart` trains it
    on one thread whatever the caller uses (float sums in another order would move it); the package ships its
    result (`stabench warm-start --retrain kl-estimator-bias/reference` trains it again)."""
    table, rng = reference_table(), np.random.default_rng(TABLE_SEED)
    with torch.random.fork_rng():
        torch.manual_seed(TABLE_SEED)
        model = tiny_policy(N_ACTIONS, ANSWER_LEN + 1, **MODEL)
    optimizer = torch.optim.Adam(model.parameters(), lr=WARMUP_LR)
    prompts = torch.full((WARMUP_BATCH, 1), N_ACTIONS, dtype=torch.long)
    for _ in range(WARMUP_STEPS):
        answers = on_default_device(sample_table(table, WARMUP_BATCH, rng))
        logits = answer_logits(model, prompts, answers, N_ACTIONS)
        loss = nn.functional.cross_entropy(logits.reshape(-1, N_ACTIONS), answers.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


# The reference, and the policy's start: each call a fresh model with the warm-up's weights (GRPO freezes its own).
reference_policy = WarmStart(
    "kl-estimator-bias/reference", _warm_up_reference, lambda: tiny_policy(N_ACTIONS, ANSWER_LEN + 1, **MODEL),
    sha256="cab8a335074bba921fe8842809a0e25be9038dd96a54fc2ee2bcc3a7bf656ac3",
)


ALL_ANSWERS = enumerate_answers(N_ACTIONS, ANSWER_LEN)
BOS = torch.tensor([N_ACTIONS])


def all_logp(model: nn.Module) -> torch.Tensor:
    """log pi(answer) for all 1,296 answers (one batched forward)."""
    with torch.no_grad():
        return all_answers_logp(prefix_logp(model, BOS, ANSWER_LEN, N_ACTIONS))


def goal_ceiling() -> float:
    """The post-onset optimum, exactly: max over pi of E_pi[R] - beta KL(pi || ref) under the injected reward.

    The maximizer is pi* ∝ ref exp(R / beta), worth beta log E_ref[exp(R / beta)]; under the control's
    reward (no rare-token term) the optimum is lower by less than 0.01.
    """
    ref_lp = all_logp(reference_policy().eval())
    reward = goal_and_rare(BOS.expand(len(ALL_ANSWERS), 1), ALL_ANSWERS).double()
    return BETA * float(torch.logsumexp(ref_lp + reward / BETA, 0))


# --- One run. ----------------------------------------------------------------------------------------------
class KLEstimatorBiasRun(GRPORun):
    """One seed under one method: the GRPO trainer, its one prompt (BOS) and the exact quantities by enumeration."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        super().__init__(budget, seed, stabilizer, diagnostics, warm=reference_policy, config=GRPO_CONFIG,
                         default_reward=first_token_zero, prompts=BOS[None])  # fmt: skip
        self.ref_logp = all_logp(self.trainer.reference)
        prompts = BOS.expand(len(ALL_ANSWERS), 1)
        self.rewards = {fn: fn(prompts, ALL_ANSWERS).double() for fn in (first_token_zero, goal_prefix, goal_and_rare)}
        self.goal = (ALL_ANSWERS[:, 0] == GOAL[0]) & (ALL_ANSWERS[:, 1] == GOAL[1])
        self.rare_share = (ALL_ANSWERS[:, RARE_POSITIONS] == RARE).double().mean(1)
        self.paying: RewardFn = first_token_zero

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        """The healthy reward before onset; from onset the goal, and in the injected branch the rare token too."""
        self.paying = (goal_and_rare if injected else goal_prefix) if after_onset else first_token_zero
        return self.paying

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        logp = self.evaluate(all_logp, self.trainer.policy)
        pi = logp.exp()
        kl = float((pi * (logp - self.ref_logp)).sum())
        exact_reward = float((pi * self.rewards[self.paying]).sum())
        objective = exact_reward - BETA * kl
        return {
            "step": float(self.trainer.tokens),
            "return": objective,
            "gt_regularized": objective,
            "gt_exact_kl": kl,
            "entropy": state.extras["entropy"],
            "reward": float(state.batch["rewards"].mean()),
            "exact_reward": exact_reward,
            "goal_mass": float(pi[self.goal].sum()),
            "rare_share": float((pi * self.rare_share).sum()),
        }


def fig_kl_estimators(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Estimated KL (k1, k2, k3, batch means per token) against the exact per-token KL (summed over the
    vocabulary at the sampled prefixes), baseline and the matched fix."""
    import matplotlib.pyplot as plt

    rows = need(table, "kl-estimator-bias", "kl_full_vocab", "kl_k1", "kl_k2", "kl_k3")
    rows = rows[rows["variant"] == "injected"]
    methods = [m for m in ("baseline", "kl-max") if m in set(rows["method"])]
    fig, axes = plt.subplots(1, len(methods), figsize=(6 * len(methods), 4), sharey=True, squeeze=False)
    for ax, method in zip(axes[0], methods):
        mine = rows[rows["method"] == method].groupby("iteration")
        for column, label in (("kl_full_vocab", "exact (full vocabulary)"), ("kl_k1", "k1"), ("kl_k2", "k2"),
                              ("kl_k3", "k3")):  # fmt: skip
            mean = mine[column].mean()
            ax.plot(mean.index, mean.values, label=label, linewidth=2.2 if column == "kl_full_vocab" else 1.2)
        onset_line(ax, rows)
        ax.set_yscale("log")
        ax.set_title(f"{method} (mean over seeds)")
        ax.set_xlabel("iteration")
    axes[0][0].set_ylabel("KL(policy || reference) per token [nats]")
    axes[0][-1].legend(loc="upper left")
    return save(fig, out, name)


class KLEstimatorBias(Task):
    """See the module docstring."""

    id = "kl-estimator-bias"
    family = "reasoning"
    version = "3"
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=120, onset=20, seeds=5),
        "full": Budget(iterations=300, onset=20, seeds=10),
    }
    ground_truth = GroundTruth(metric="gt_regularized", threshold=5.3, fails_when="below", reduce="tail_mean")
    matched_fix = "kl-max"
    methods = ("baseline", "kl-max", "kl-k2", "kl-k1-reward")
    detector = DetectorSpec(metric="kl_k1", threshold=1.5)
    diagnostics = ("kl_estimators", "grad_norms")
    privileged = ("exact_reward", "goal_mass", "rare_share")  # exact by enumeration
    # Floor: the frozen-at-onset runs' exact objective (injected reward), mean over seeds 0-9, quick tier (version 3,
    # measured on the machine of its calibration runs). Ceiling: `goal_ceiling()`, the exact regularized optimum (a
    # test checks it).
    return_floor = 0.7528646005448179
    return_ceiling = 6.413460597905584
    environments = {"stabench/KLTokens-v0": "KLTokensEnv"}
    figures = (
        Figure("estimators", "KL estimators vs exact KL",
               "Per-token KL estimates (k1, k2, k3) against the exact per-token KL, baseline (k3 in the loss) and "
               "the max-of-estimators fix.", fig_kl_estimators),
    )  # fmt: skip
    paper = """On kl-estimator-bias a tiny transformer starts as a copy of its reference and, from onset, is paid for
a goal the reference rarely writes; in the injected branch it is also paid for a token the reference almost never
writes. GRPO's k3 estimator in the loss has, on policy, the gradient of the forward KL, whose pull back on an
over-weighted token is bounded, so the rare token runs away and the exact regularized objective falls, while the
logged estimates of the KL still track the exact value: only the gradient is wrong. The max-of-estimators fix
(k2 where the policy over-weights a token, k3 elsewhere) stops the runaway, but k2 in the loss or k1 in the reward
learn the new goal better (figure below)."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> KLEstimatorBiasRun:
        return KLEstimatorBiasRun(self.budget(tier), seed, stabilizer, self.diagnostics)
