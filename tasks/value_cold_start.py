"""value-cold-start: a critic replaced mid-run by a mis-scaled value head sends wrong advantages (seed 001 §2.1).

The world. A tiny GPT-2 policy (1 layer, 32 wide, built from a config) writes a chain of 5 tokens from a
vocabulary of 4; step t (t = 1..4) is valid when the move a_t - a_{t-1} (mod 4) belongs to the rule's set
of moves. The reward is terminal: the number of leading valid steps over 4 (a chain: a step counts only if
every step before it did). All 4**5 = 1,024 answers are enumerable, so the exact expected reward and the
exact success probability (all four steps valid) come from one batched forward every iteration; the same
next-token tables sample the batch (`TableSampler`, an exact ancestral sampler). Trainer: token PPO with a
separate critic (`baselines/token_ppo.py`: an MLP over the one-hot prefix), 64 answers per iteration,
GAE over the answer tokens with gamma 1 and lambda 0.5, normalized advantages, 2 epochs, clip 0.2, Adam
3e-3 for the policy and the critic.

The schedule. Healthy phase: the rule's moves are {+1, +2}. At onset the rule switches to {0, +3} in BOTH
branches (every move the healthy policy learned becomes invalid). The injection, in the injected branch
only: the critic is replaced at onset by a freshly initialized value head whose output layer is
`CRITIC_SCALE` = 30 times too large (CleanRL's head has weights of std 1 / sqrt(width); this one 30 /
sqrt(width)), as happens when a new value head is bolted on. The control is the task switch alone: same
schedule, the old critic kept. So the injected branch differs from the control only by the critic.

Ground truth: the exact expected reward under the current rule ("return"), averaged over the last quarter
of the run, below 0.5: the policy does not get even half of the chain right on average, i.e. it has not
learned the new rule. A fixed constant, chosen from what failure means, not from the runs.

EXPERIMENTAL: the calibration does not reach the suite's bar (the baseline fails on 1 of 5 seeds, not 4).

Measured (quick tier: onset 10, 70 iterations; seeds 0-4; tail = the last 18 iterations' exact return):
| method | injected tail return | control tail return | failed (injected / control) | normalized return |
|---|---|---|---|---|
| baseline | 0.98 0.99 0.83 0.04 0.99 | 1.00 x5 | 1/5 / 0/5 | 0.59 [0.32, 0.81] |
| critic-warmup (20 iterations) | 1.00 0.98 1.00 0.95 0.99 | 1.00 x5 | 0/5 / 0/5 | 0.58 [0.53, 0.61] |
| ppo-critic-entropy-bonus (0.05) | 0.99 0.35 0.96 0.96 1.00 | 1.00 x5 | 1/5 / 0/5 | 0.64 [0.47, 0.80] |
The three variants the brief asks to separate (baseline, same seeds, tail return): (a) switch + critic reset
(the injected branch) 0.98 0.99 0.83 0.04 0.99; (b) switch alone (the control) 1.00 x5; (c) nothing switches
(old rule, old critic) 0.99 0.99 0.08 1.00 1.00. So the task switch alone never breaks the baseline, but (c)
shows that plain token PPO with normalized advantages can also fall off a solved task by itself (seed 2:
once every answer earns the same reward, the normalized advantages are pure critic noise).

Mechanism, as measured. The injected head is visible at once and stays visible: the critic's RMSE against
the Monte-Carlo return (`value_error`) jumps from 0.3-0.4 to 5.5-12 at onset and, in the baseline, stays at
2-6 for the whole run (it even grows in the runs that learn): the trainer's lambda-return targets bootstrap
from the broken head ((1 - lambda) V(s_{t+1}) per step), so it chases its own errors. The warm-up, which
regresses on Monte-Carlo returns, brings it to 0.5-0.7 by the end of its 20 iterations (0.1-0.4 later; one seed drifts
back to 2.7 once bootstrapping resumes). Yet the policy mostly learns the new rule despite the broken critic:
a per-state error V(s_t) is an action-independent baseline (no bias in expectation), and with lambda = 0.5
only the (1 - lambda) V(s_{t+1}) share biases the advantages, towards a random ranking of the next states
that moves as the critic moves; the true signal wins on most seeds. Where the baseline fails (seed 3) the
policy wanders at entropy 0.65-1.0 for 40 iterations at return 0.05-0.25 and then commits to wrong moves
(entropy 0.27, return 0.03); seed 2 is slowed (0.83). The fix's normalized return is not above the
baseline's: it pays for 20 iterations of frozen policy after onset. The entropy guard fails a different seed.
So the diagnostic is clean (the threshold detector on `value_error` fires at onset on every injected run and
never on a control) while the return damage is a seed-dependent race, not the reliable early collapse the
failure mode names. Levers tried without reaching 4/5 (baseline, 4-5 seeds each, same harness): critic
scale 10 (0/2 failed) or 100 (2/4); lambda 0 at scale 10 (1/4, controls at 0.50 and 0.32) or 0.3
(2/5, one control fails); policy lr 1e-2 (2/5); lr 1e-2 with lambda 0.3 (3/5, one control fails); lr 1e-2
with scale 100 (0/5: a larger head fails LESS, so the damage is not monotone in the value error); a
success-only reward (1/4, one control fails). In prototypes with a later onset (30-40), after the healthy
policy had committed to one path (entropy 0.1-0.3), the task switch alone broke the control on some seeds:
a committed policy cannot re-explore, which is not the critic's failure; hence the early onset, with the
policy still broad.

Suite 0.3.0: the plain guard `ppo-critic-entropy-bonus` is retired for the one `entropy-bonus` (0.05 times the
exact entropy, added to token-PPO's own term, 0 here: the same loss); the critic-warmup now reads the
Monte-Carlo return-to-go as `mc_returns` (`returns` holds the value targets, as in every trainer). Re-run at
the quick tier (5 seeds): baseline 1/5 fail, critic-warmup 0/5, entropy-bonus 0/5; verdict unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from stabench.baselines.token_ppo import PrefixCritic, TokenPPO, TokenPPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.tokens import (
    AnswerEnv,
    all_answers_logp,
    enumerate_answers,
    on_default_device,
    prefix_logp,
    tiny_policy,
)
from torch import nn

# --- The world: 4 tokens, chains of 5 (4**5 = 1,024 answers, all enumerable). -------------------------------
N_ACTIONS = 4
ANSWER_LEN = 5
MOVES_BEFORE = (1, 2)  # valid moves a_t - a_{t-1} mod 4 before onset (and in neither branch after)
MOVES_AFTER = (0, 3)  # valid moves from onset on, in both branches

# --- The policy, the critic and the trainer. --------------------------------------------------------------
MODEL = {"n_embd": 32, "n_layer": 1, "n_head": 2}
CRITIC_WIDTH = 32
CRITIC_SCALE = 30.0  # the injected value head's output scale (the healthy head's is 1)
RESET_SEED_OFFSET = 7919  # the injected head's init is seeded by seed + this offset
PPO_CONFIG = TokenPPOConfig(
    n_answers=64, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=3e-3, critic_lr=3e-3, gamma=1.0,
    gae_lambda=0.5, epochs=2, minibatches=1, clip_coef=0.2, vf_coef=0.5, ent_coef=0.0, norm_adv=True,
)  # fmt: skip
FAIL_BELOW = 0.5  # ground truth: tail-mean expected reward below half the chain


# --- Rewards: the environment and the trainer both call these. --------------------------------------------
def valid_steps(answers: torch.Tensor, moves: tuple[int, ...]) -> torch.Tensor:
    """[B, L - 1]: 1.0 where step t is valid AND every step before it was (the chain's leading valid steps)."""
    move = (answers[:, 1:] - answers[:, :-1]) % N_ACTIONS
    return torch.isin(move, torch.tensor(moves)).float().cumprod(1)


def chain_reward(moves: tuple[int, ...]):
    """The reward function of a rule: the share of the chain's steps that are valid from the start on."""

    def reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        return valid_steps(answers, moves).mean(1)

    reward.moves = moves  # type: ignore[attr-defined]
    return reward


REWARD_BEFORE, REWARD_AFTER = chain_reward(MOVES_BEFORE), chain_reward(MOVES_AFTER)


class ChainEnv(AnswerEnv):
    """The task as a gymnasium environment: write 5 tokens; `switched` picks the post-onset rule."""

    def __init__(self, switched: bool = False) -> None:
        super().__init__(REWARD_AFTER if switched else REWARD_BEFORE, N_ACTIONS, ANSWER_LEN)



# --- Exact sampling and evaluation from the enumerated next-token tables. -----------------------------------
ALL_ANSWERS = enumerate_answers(N_ACTIONS, ANSWER_LEN)
BOS = torch.tensor([N_ACTIONS])


class TableSampler:
    """Ancestral sampling from the policy's next-token tables (one forward over all 256 prefixes).

    The same distribution as `tasks.tokens.sample_answers` (inverse CDF, one uniform of `rng` per answer and
    position) for a single prompt; it keeps the table (`self.table`, from `prefix_logp`) so the run reads the
    exact return of the very policy that sampled the batch at no extra cost.
    """

    def __init__(self) -> None:
        self.table: torch.Tensor | None = None

    def __call__(self, model: nn.Module, prompts: torch.Tensor, length: int, n_actions: int,
                 rng: np.random.Generator) -> torch.Tensor:
        if not bool((prompts == prompts[:1]).all()):
            raise ValueError("TableSampler samples for one prompt repeated over the batch")
        with torch.no_grad():
            self.table = prefix_logp(model, prompts[0], length, n_actions)
        n = len(prompts)
        row = torch.zeros(n, dtype=torch.long)  # the table row of the prefix so far (unwritten tokens as 0)
        out = torch.zeros(n, length, dtype=torch.long)
        for t in range(length):
            cdf = self.table[row, t].exp().cumsum(-1)
            u = on_default_device(rng.random(n))[:, None] * cdf[:, -1:]
            out[:, t] = (cdf < u).sum(-1).clamp_max(n_actions - 1)
            if t < length - 1:
                row = row + out[:, t] * n_actions ** (length - 2 - t)
        return out


# --- Knobs. ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """Keyword arguments of `ValueColdStart`."""

    onset: int | None = None  # overrides the quick and full tiers' onset iteration
    critic_scale: float = CRITIC_SCALE  # output scale of the value head installed at onset (injected branch)

    def check(self, iterations: int) -> None:
        """Raise StabenchError, naming the knob, for any value the task cannot run with."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "onset" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise StabenchError(f"value-cold-start: knob {f.name} must be a number, got {value!r}")
        if self.onset is not None:
            if not isinstance(self.onset, int):
                raise StabenchError(f"value-cold-start: onset must be an integer, got {self.onset!r}")
            if not 0 < self.onset < iterations:
                raise StabenchError(f"value-cold-start: onset {self.onset} must lie strictly inside the run of "
                                    f"{iterations} iterations")
        if not (math.isfinite(self.critic_scale) and self.critic_scale > 0):
            raise StabenchError(f"value-cold-start: critic_scale must be a finite number > 0, got {self.critic_scale}")


# --- One run. ----------------------------------------------------------------------------------------------
class ValueColdStartRun:
    """One seed under one method: the token-PPO trainer (policy, critic, both Adams, sampler Generator)."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 critic_scale: float) -> None:
        self.onset, self.seed, self.diagnostics, self.critic_scale = budget.onset, seed, diagnostics, critic_scale
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            policy = tiny_policy(N_ACTIONS, ANSWER_LEN + 1, **MODEL)
            critic = PrefixCritic(N_ACTIONS, ANSWER_LEN, CRITIC_WIDTH)
        self.trainer = TokenPPO(policy, critic, REWARD_BEFORE, replace(PPO_CONFIG, seed=seed), stabilizer)
        self.sampler = TableSampler()
        self.trainer.sample = self.sampler
        self.rewards = {fn: fn(None, ALL_ANSWERS).double() for fn in (REWARD_BEFORE, REWARD_AFTER)}
        self.success = {fn: valid_steps(ALL_ANSWERS, fn.moves).prod(1).double() for fn in (REWARD_BEFORE, REWARD_AFTER)}

    def reset_critic(self) -> None:
        """The injection: a fresh value head `critic_scale` times too large replaces the critic."""
        with torch.random.fork_rng():
            torch.manual_seed(self.seed + RESET_SEED_OFFSET)
            critic = PrefixCritic(N_ACTIONS, ANSWER_LEN, CRITIC_WIDTH, out_scale=self.critic_scale)
        self.trainer.reset_critic(critic)

    def step(self, injected: bool) -> dict[str, float]:
        tr = self.trainer
        switched = tr.iteration >= self.onset  # the task switch: both branches
        if injected and tr.iteration == self.onset:
            self.reset_critic()
        reward_fn = REWARD_AFTER if switched else REWARD_BEFORE
        state = tr.iterate(reward_fn)
        pi = all_answers_logp(self.sampler.table).exp()  # the policy that sampled this iteration's batch
        ret = float((pi * self.rewards[reward_fn]).sum())
        row: dict[str, float] = {
            "step": float(tr.tokens),
            "return": ret,  # exact expected reward under the current rule
            "entropy": state.extras["entropy"],
            "success": float((pi * self.success[reward_fn]).sum()),  # exact P(all four steps valid)
            "reward": float(state.batch["rewards"].mean()),
            "critic_age": float(state.extras["critic_age"]),
            "policy_loss": state.losses.get("policy", math.nan),
            "value_loss": state.losses.get("value", math.nan),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class ValueColdStart(Task):
    """See the module docstring."""

    id = "value-cold-start"
    family = "reasoning"
    version = "1"
    trainer = "token-ppo"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=70, onset=10, seeds=5),
        "full": Budget(iterations=130, onset=10, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=FAIL_BELOW, fails_when="below", reduce="tail_mean",
                               tail=0.25)
    matched_fix = "critic-warmup"
    methods = ("baseline", "critic-warmup", "entropy-bonus")
    # The critic's RMSE on the batch: a healthy critic sits near 0.3-0.5 (the spread of returns given a prefix);
    # right after the task switch the old critic reads up to 1; a mis-scaled head reads several times that.
    detector = DetectorSpec(metric="value_error", threshold=1.5)
    diagnostics = ("value_fit",)
    return_floor = 0.0  # no valid step
    return_ceiling = 1.0  # every step valid
    knobs_type = Knobs
    experimental = True  # see the module docstring: the baseline fails on 1 of 5 seeds

    def __init__(self, **knobs: object) -> None:
        super().__init__(**knobs)
        if not hasattr(self, "knobs"):
            self.knobs = Knobs()

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> ValueColdStartRun:
        return ValueColdStartRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.critic_scale)
