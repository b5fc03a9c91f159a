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

The phases. Healthy (iterations 0-19): reward 1 if the first token is 0. From onset (iteration 20) the goal
moves in BOTH branches: 8 for answers that start with 0 then 4 (reference mass 0.033, the onset policy's
0.10-0.16). Its reverse-KL-regularized optimum pi* ∝ ref exp(R / beta) puts 1.00 on the goal (exact KL 3.6
nats) and is worth 6.29 (6.33 with the injected term below), against 0.53-0.92 for the policy frozen at
onset (seeds 0-9) and 0.27 for the reference: learning is required. The injection: the injected branch is
ALSO paid 3 times the share of positions 2-3 that hold the rare token (1.5 per position). The regularized
optimum hardly wants it: exp(1.5 / beta) = 20 times the reference's rare-token probability (share 0.05 at
the optimum), worth 0.05 more.

The mechanism (on one token position, tests/test_token_family.py checks it exactly): on-policy, the
expected gradient of k3 in the loss is that of the FORWARD KL(ref || pi): its pull on an over-weighted
token p is beta (p - ref), bounded, while the reward pushes with r p (1 - p); with r = 1.5 > beta the
rare token settles near 1 - beta / r = 2/3 instead of 0.06. max(k2, k3) in the loss (k2 = the exact
per-token reverse-KL gradient where the policy over-weights) holds it near the optimum; k2 everywhere and
k1 in the reward (the unbiased sequence-level reverse-KL gradient) too.

As the calibration measured it (quick tier: 120 iterations, onset 20; seeds 0-9, all six methods). At
onset the policy puts 0.10-0.16 on the goal (exact KL 0.45-0.68 from the healthy phase). Every learning
method then learns the goal within about 10 iterations (baseline control: goal mass 0.13 at onset, 0.86
ten iterations later; 0.88 (0.85-0.91) over the last quarter with k3 or max(k2, k3) in the loss, 1.00
with k2 or k1 in the reward). With k3 in the loss the injected branch then grows the rare token at
positions 2-3 (mean share 0.01 ten iterations after onset, 0.16 after 20, about 0.6 from 40 on; 0.59 over
the last quarter, 0.00 in its control): the exact KL reaches 8.5 nats over the last quarter (control 2.9)
and the regularized objective falls to 4.55 (4.37-4.62 per seed; control 5.61). max(k2, k3) keeps the rare
share at 0.03 (at most 0.07) and the objective at 5.58 (5.39-5.66), like its control. k3 in the loss also
costs the CONTROL some of the goal (5.61 over the last quarter, where k2 and k1-in-reward reach 6.24-6.31,
near the optimum 6.29): its forward-KL pull keeps mass on the reference's other answers. At lr 1e-2 the
token-level fixes have occasional one- or two-iteration dips (kl-max injected seed minimum 1.74, kl-k2
control -0.98 within the last quarter) that recover; no run diverged.

Return: the exact regularized objective E_pi[R] - beta KL(pi || ref) under the branch's current reward
(control: the goal; injected: the goal plus the rare-token term), by enumeration. Normalized return 1 is
the exact optimum under the injected reward, beta log E_ref[exp(R / beta)] = 6.334 (`goal_ceiling()`;
the control's own optimum is 0.046 lower). Normalized return 0 is the policy frozen at onset: its exact
objective under the injected reward, averaged over the frozen-at-onset runs of seeds 0-9 (0.53-0.92 per
seed, mean 0.7375), fixed as a number; the reference (a learner that never updates) is worth 0.27, -0.08.

Ground truth: the exact regularized objective (column `gt_regularized`, the same number as the return)
averaged over the last quarter of the run falls below 5.0. Neither the reference (0.27) nor the onset
policy (at most 0.92) can reach it; the control reaches 5.56-5.65; threshold set on design runs of seeds
0-1 (between the baseline's 4.6 and the fix's 5.6 there).

10-seed numbers (quick tier, seeds 0-9; failure rate, control failure rate, normalized return [95% CI]):
baseline 1.00, 0.00, 0.754 [0.739, 0.767] (control 0.84); kl-max 0.00, 0.00, 0.831 [0.826, 0.835];
kl-k2 0.00, 0.00, 0.945 [0.942, 0.949]; kl-k1-reward 0.00, 0.00, 0.941 [0.936, 0.946]; no-update 1.00,
-0.084; frozen-at-onset 1.00, 0.000 [-0.013, 0.013]. Fresh seeds 100-109 (not tuned on): baseline 1.00,
0.00, 0.737 [0.720, 0.754] (control 0.84; objective over the last quarter 4.38-4.74, control 5.59-5.67);
kl-max 0.00, 0.00, 0.838 [0.835, 0.841] (5.55-5.66); no-update 1.00, -0.084; frozen-at-onset 1.00,
-0.007 [-0.024, 0.010].
One quick trial: about 10 s of CPU on one core (11-18 s wall on this shared, loaded 2-core machine).

Settings and where they were chosen: goal (0, 4), goal reward 8, rare reward 3 at positions 2-3, lr 1e-2,
Dr. GRPO advantages, 120 iterations with onset 20, on design runs of seeds 0-1. Tried there: GRPO's
std-normalized advantages (goal (1, 2) paid 6, lr 3e-3): the learner does not see the reward's scale, the
goal mass stalled at 0.57 against an optimum of 0.99 and the rare token never grew within the run; goal
reward 4 with Dr. GRPO: k3 and max(k2, k3) alike settle near 0.77 goal mass, the control at 0.75 of the
optimum; lr 3e-3: the rare token grew too slowly to fail within the run. Version 1 (reward: only the rare-token share,
from onset 50) asked nothing to be learned: a learner that never updated scored 1.00.

Diagnostics, measured. The logged batch means of k1 and k3 and the full-vocabulary per-token KL track the
exact KL (baseline injected, last quarter: k1 about 2.1 per token, 8.5 nats per answer): the k3 VALUE does
not hide the failure, only its gradient is wrong. The default detector is a KL budget on the logged k1:
per-token mean above 1.5 (6 nats per answer; the optimum needs 3.6). The threshold was chosen on the
seeds 100-109 runs only: there the largest post-onset k1 of any control or kl-max run is 1.04 (0.24
before onset), and every baseline injected run passes 1.5 at iterations 52-96 (its largest k1 2.64-2.98).
On seeds 0-9 one baseline control (seed 4) spikes to 1.92 at iteration 24 while learning the goal fast:
a false alarm at 1.5. The detection window, 0.75 of the post-onset horizon, was set from the seeds 0-9
crossings (37-74 iterations after onset, seed 4's goal-learning spike aside); seed 108's crossing (76
after onset) falls just outside it. Unlike version 1, the k2/k3 ratio now separates too (baseline
injected 2.6-2.8 post-onset, kl-max at most 1.42 after onset but up to 1.78 before it; seeds 100-109):
the fix keeps the rare token near its optimum.

Suite 0.3.0 re-measured on seeds 0-9 in the method matrix (`results/matrix`): rows of `kl-max`, `kl-k2`,
`kl-k1-reward`, the baseline and both references are bit for bit those of 0.2.0 (baseline 10/10 fail, control
0/10 at 0.84; kl-max 0/10, 0.83 [0.83, 0.84]; references 10/10). Of the other methods only `kl-anchor` (4/10
fail) and `kl-k2-anchor` (6/10, and 2/10 control failures: an anchor of 0.05 k2 in place of beta k3 slows the
goal learning) change the failure rate.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from stabench.baselines.grpo import GRPO, GRPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.tokens import (
    AnswerEnv,
    all_answers_logp,
    answer_logits,
    enumerate_answers,
    on_default_device,
    prefix_logp,
    tiny_policy,
    warm_start,
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
GOAL = (0, 4)  # post-onset target: answers that start with 0 then 4 (reference mass 0.033)
GOAL_REWARD = 8.0  # paid for the target; large against beta, so the regularized optimum moves far from the onset policy
RARE_POSITIONS = slice(2, 4)  # the injected pull: the rare token at positions 2-3
RARE_REWARD = 3.0  # paid times the share of those positions holding the rare token


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


_REFERENCE_STATE: dict[str, torch.Tensor] = {}


def reference_policy() -> nn.Module:
    """The frozen reference: the tiny transformer after a short supervised warm-up on table samples.

    Deterministic (its own seeds, and one thread whatever the caller uses: float sums in a different
    order would move it); cached by `warm_start`.
    """
    if not _REFERENCE_STATE:
        _REFERENCE_STATE.update(warm_start("kl-estimator-bias/reference", _warm_up_reference, __file__))
    with torch.random.fork_rng():
        model = tiny_policy(N_ACTIONS, ANSWER_LEN + 1, **MODEL)
    model.load_state_dict(_REFERENCE_STATE)
    return model.eval().requires_grad_(False)


def _warm_up_reference() -> nn.Module:
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
    ref_lp = all_logp(reference_policy())
    reward = goal_and_rare(BOS.expand(len(ALL_ANSWERS), 1), ALL_ANSWERS).double()
    return BETA * float(torch.logsumexp(ref_lp + reward / BETA, 0))


# --- One run. ----------------------------------------------------------------------------------------------
class KLEstimatorBiasRun:
    """One seed under one method: a GRPO trainer with the policy, reference, optimizer and sampler state."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        self.budget, self.diagnostics = budget, diagnostics
        reference = reference_policy()
        policy = reference_policy().train().requires_grad_(True)  # the policy starts as a copy of the reference
        config = replace(GRPO_CONFIG, seed=seed)
        self.trainer = GRPO(policy, reference, first_token_zero, config, stabilizer)
        self.ref_logp = all_logp(reference)
        prompts = BOS.expand(len(ALL_ANSWERS), 1)
        self.rewards = {fn: fn(prompts, ALL_ANSWERS).double() for fn in (first_token_zero, goal_prefix, goal_and_rare)}
        self.goal = (ALL_ANSWERS[:, 0] == GOAL[0]) & (ALL_ANSWERS[:, 1] == GOAL[1])
        self.rare_share = (ALL_ANSWERS[:, RARE_POSITIONS] == RARE).double().mean(1)

    def step(self, injected: bool) -> dict[str, float]:
        if self.trainer.iteration < self.budget.onset:
            reward_fn = first_token_zero
        else:
            reward_fn = goal_and_rare if injected else goal_prefix
        state = self.trainer.iterate(reward_fn)

        logp = all_logp(self.trainer.policy)
        pi = logp.exp()
        kl = float((pi * (logp - self.ref_logp)).sum())
        exact_reward = float((pi * self.rewards[reward_fn]).sum())
        objective = exact_reward - BETA * kl
        row: dict[str, float] = {
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
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class KLEstimatorBias(Task):
    """See the module docstring."""

    id = "kl-estimator-bias"
    family = "reasoning"
    version = "2"
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=120, onset=20, seeds=5),
        "full": Budget(iterations=300, onset=20, seeds=10),
    }
    ground_truth = GroundTruth(metric="gt_regularized", threshold=5.0, fails_when="below", reduce="tail_mean")
    matched_fix = "kl-max"
    methods = ("baseline", "kl-max", "kl-k2", "kl-k1-reward")
    detector = DetectorSpec(metric="kl_k1", threshold=1.5)
    diagnostics = ("kl_estimators", "grad_norms")
    privileged = ("exact_reward", "goal_mass", "rare_share")  # exact by enumeration
    # Floor: the frozen-at-onset runs' exact objective (injected reward), mean over seeds 0-9, quick tier.
    # Ceiling: `goal_ceiling()`, the exact regularized optimum (a test checks it).
    return_floor = 0.7375227478807367
    return_ceiling = 6.333804657710605

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> KLEstimatorBiasRun:
        return KLEstimatorBiasRun(self.budget(tier), seed, stabilizer, self.diagnostics)
