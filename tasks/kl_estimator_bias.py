"""kl-estimator-bias: GRPO's k3-in-the-loss regularizer bounds the wrong divergence (Shah et al. 2025).

The world. A tiny GPT-2 policy (1 layer, 32 wide, built from a config) writes answers of 4 tokens from a
vocabulary of 6; all 6**4 = 1,296 answers can be enumerated, so the exact sequence-level KL(pi || ref) is
computed every iteration (one batched forward). The frozen reference is the same transformer after a
short supervised warm-up on answers sampled from a fixed Markov table (smooth seeded logits over tokens
0-4 conditioned on position and previous token, +1 for repeating the previous token, the rare token 5 at
probability 0.003 everywhere); the policy starts as a copy of the reference. GRPO: 16 groups of 8 answers,
advantages (R - group mean) / (group std + 1e-4), Adam lr 3e-3, one update per batch, token-mean losses,
beta = 0.5 times k3 = exp(d) - 1 - d, d = log ref - log pi, in the loss (as in TRL).

The injection. Healthy phase and control: reward 1 if the first token is 0. From onset (iteration 50) the
injected branch is paid the share of positions 1-3 that hold the rare token: a reward that pulls toward
answers the reference almost never writes. The regularized objective E_pi[R] - beta KL(pi || ref) hardly
wants to move: its optimum pi* ∝ ref exp(R / beta) is worth only 0.0011 more than the reference itself.

Ground truth: the exact KL(pi || ref) crossing a budget of 3 nats at any post-onset iteration.

Mechanism, as the calibration measured it (seeds 0-9, 400 iterations, all four methods): on-policy, the
expected gradient of k3 in the loss is the gradient of the FORWARD KL(ref || pi), whose pull on an
over-weighted token is bounded (1 - ref/pi per sample) while the reverse KL's grows with log(pi/ref). Right
after onset almost no answer earns reward, advantages vanish and every method relaxes toward the reference
(exact KL 0.9-1.8 at onset, 0.09-0.26 some 10-20 iterations later). Then a sampled rare token earns a large
normalized advantage (one hit in a group of 8 gets A = 2.5); the boost starts on the prefixes where rare
tokens were sampled and, the transformer sharing its parameters across prefixes, spreads to all of them
within a few iterations (seed 0 at iteration 400: p(rare) 0.45-0.50 at positions 1-3 under every prefix,
against 0.003 under the reference). The recipe feared that a transformer might, like a table conditioned on
the full prefix, cross only marginally; it crosses cleanly. With k3 in the loss the exact reverse KL goes
from 0.2 to past 3 nats within ~10 iterations (crossing at iterations 64-87) and settles at 5.7-7.3 nats
(mass-covering: E_pi[R] 0.4-0.5, entropy still 1.4-1.5), while k2 in the loss, max(k2, k3) in the loss and
k1 in the reward all hold it near 0.6 nats (E_pi[R] about 0.08; their largest post-onset KL, 0.8-1.8, is
the healthy phase's drift that they carry into the onset).

Diagnostics, measured. The logged batch means of k1 and k3 (and the full-vocabulary per-token KL) track the
exact KL within a few percent on every run: the k3 VALUE does not hide the failure, only its gradient is
wrong; k2 reads about 3x too high far from the reference (19.9 against an exact 6.6). A budget on the
logged k1 (per-token mean above 0.5, i.e. 2 nats per answer; the default detector) raises its alarm
between one iteration before and one after the crossing and never on a control, a fixed run or before
onset. The commonly prescribed k2/k3 disagreement is NOT specific: the raw ratio passes 2 two to five
iterations before the baseline's crossing, but it also passes 2 in every fixed run (their steady ratio is
2.24-2.35 at an exact KL of 0.6, the baseline's 3.0; controls stay below 1.8): it measures how heavy the
log-ratio tail is (a rare token the policy over-weights), not which estimator drives the gradient.
Gradient norms and entropy move in every injected run and do not single out the failing one.

Return: the exact regularized objective E_pi[R] - beta KL(pi || ref) under the branch's current reward.
Normalized return 1 is the reverse-KL-regularized optimum beta log E_ref[exp(R / beta)] (which barely
moves from the reference: it is worth only 0.0011 more than the reference itself); normalized return 0 is
a policy that exploits the reward completely, always writing the highest-reward answer the reference
finds likeliest (worth R + beta log ref of that answer). Both are computed exactly by enumeration.
"""

from __future__ import annotations

from dataclasses import replace

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from baselines.grpo import GRPO, GRPOConfig
from suite.api import Budget, DetectorSpec, GroundTruth, Stabilizer, Task
from suite.diagnostics import DIAGNOSTICS
from tasks.tokens import (
    AnswerEnv,
    all_answers_logp,
    answer_logits,
    enumerate_answers,
    on_default_device,
    prefix_logp,
    tiny_policy,
    warm_start,
)

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
GRPO_CONFIG = GRPOConfig(n_groups=16, group_size=8, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=3e-3, beta=BETA)


# --- Rewards: the environment and the trainer both call these. --------------------------------------------
def first_token_zero(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Healthy phase (and the control throughout): 1 if the answer starts with token 0."""
    return (answers[:, 0] == 0).float()


def rare_token_share(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """From onset (the injection): the share of positions 1-3 that hold the rare token."""
    return (answers[:, 1:] == RARE).float().mean(1)


class KLTokensEnv(AnswerEnv):
    """The task as a gymnasium environment: write 4 tokens; `injected` picks the post-onset reward."""

    def __init__(self, injected: bool = False) -> None:
        super().__init__(rare_token_share if injected else first_token_zero, N_ACTIONS, ANSWER_LEN)


if "stabench/KLTokens-v0" not in gym.registry:
    gym.register(id="stabench/KLTokens-v0", entry_point=KLTokensEnv)


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


def regularized_bounds() -> tuple[float, float]:
    """(floor, ceiling) of the return E_pi[R] - beta KL(pi || ref) under the post-onset reward, exactly.

    Floor: a policy that exploits the reward completely, i.e. always writes the highest-reward answer
    (of those, the one the reference finds likeliest); a deterministic policy on answer a is worth
    R(a) + beta log ref(a). Ceiling: the optimum of the reverse-KL-regularized objective,
    pi* ∝ ref exp(R / beta), worth beta log E_ref[exp(R / beta)].
    """
    ref_lp = all_logp(reference_policy())
    reward = rare_token_share(BOS.expand(len(ALL_ANSWERS), 1), ALL_ANSWERS).double()
    best = reward == reward.max()
    floor = float((reward + BETA * ref_lp)[best].max())
    ceiling = BETA * float(torch.logsumexp(ref_lp + reward / BETA, 0))
    return floor, ceiling


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
        self.rewards = {fn: fn(prompts, ALL_ANSWERS).double() for fn in (first_token_zero, rare_token_share)}

    def step(self, injected: bool) -> dict[str, float]:
        switched = injected and self.trainer.iteration >= self.budget.onset
        reward_fn = rare_token_share if switched else first_token_zero
        state = self.trainer.iterate(reward_fn)

        logp = all_logp(self.trainer.policy)
        pi = logp.exp()
        kl = float((pi * (logp - self.ref_logp)).sum())
        exact_reward = float((pi * self.rewards[reward_fn]).sum())
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": exact_reward - BETA * kl,
            "entropy": state.extras["entropy"],
            "gt_exact_kl": kl,
            "reward": float(state.batch["rewards"].mean()),
            "exact_reward": exact_reward,
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class KLEstimatorBias(Task):
    """See the module docstring."""

    id = "kl-estimator-bias"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=150, onset=50, seeds=5),
        "full": Budget(iterations=400, onset=50, seeds=10),
    }
    ground_truth = GroundTruth(metric="gt_exact_kl", threshold=3.0, fails_when="above", reduce="any")
    matched_fix = "kl-max"
    methods = ("baseline", "kl-max", "kl-k2", "kl-k1-reward")
    # Budget alarm on the logged k1 (per-token batch mean): 0.5 per token = 2 nats per answer, below the 3-nat budget.
    detector = DetectorSpec(metric="kl_k1", threshold=0.5)
    diagnostics = ("kl_estimators", "grad_norms")
    # Exact values from `regularized_bounds()` (checked by tests/test_token_family.py); fixed per task version.
    return_floor = -8.11502484800181  # regularized_bounds(); a test checks both
    return_ceiling = 0.0038253907880525517
    # Quick-tier crossings come 14-30 iterations after onset: a window of 30 of the 100 covers them all.
    detection_window = 0.3

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> KLEstimatorBiasRun:
        return KLEstimatorBiasRun(self.budget(tier), seed, stabilizer, self.diagnostics)
