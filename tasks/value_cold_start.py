"""value-cold-start: a critic replaced mid-run by a mis-scaled value head sends wrong advantages (seed 001 §2.1).
EXPERIMENTAL: the fresh seeds 100-109 miss the bar (results/calibration.md).

The world. A tiny GPT-2 policy (1 layer, 32 wide, built from a config) writes a chain of 5 tokens from a
vocabulary of 4; step t (t = 1..4) is valid when the move a_t - a_{t-1} (mod 4) belongs to the rule's set
of moves. The reward is terminal: the number of leading valid steps over 4 (a chain: a step counts only if
every step before it did). All 4**5 = 1,024 answers are enumerable, so the exact expected reward and the
exact success probability (all four steps valid) come from one batched forward every iteration; the same
next-token tables sample the batch (`TableSampler`, an exact ancestral sampler). Trainer: token PPO with a
separate critic (`baselines/token_ppo.py`, unchanged: an MLP over the one-hot prefix), 64 answers per
iteration, GAE over the answer tokens with gamma 1 and lambda 0.9, advantages NOT normalized per batch, 2
epochs, clip 0.2, Adam 3e-3 for the policy and the critic.

The schedule (quick tier: 90 iterations, onset 5). Healthy phase: the rule's moves are {+1, +2}. At onset the
rule switches to the single move {+3} in BOTH branches: a new rule to learn, which the control finds. The
injection, in the injected branch only: the critic is replaced at onset by a freshly initialized value head
whose output layer is `CRITIC_SCALE` = 30 times too large (CleanRL's head has weights of std 1 / sqrt(width);
this one 30 / sqrt(width)), as happens when a new value head is bolted on. The control is the task switch
alone (the old critic kept).

Ground truth: the exact expected reward under the current rule ("return"), averaged over the last quarter of
the run, below 0.5 (not even half the chain on average: the new rule is not learned). A learner that never
learns fails it: the uniform policy earns (1/4 + 1/16 + 1/64 + 1/256) / 4 = 0.083 on the new rule.
Normalized return: the floor is frozen-at-onset's mean post-onset return, the ceiling the baseline
control's (it reaches the optimum, 1, but only after many iterations of learning), both on seeds 0-9 at the
quick tier, measured once and fixed. The measured numbers are in results/calibration.md.

Mechanism. At onset the healthy policy is still broad. The injected head's value errors are many times the
reward signal and, with advantages not normalized, they drive the policy for as long as they stay large: the
baseline follows the head instead of the reward and learns the new rule late, a delay that the budget turns
into failure rather than a permanent collapse. The matched fix, `critic-warmup`, shows the cost is the
critic's, not the rule's: the policy waits while the head regresses on Monte-Carlo returns, then learns at
the control's pace. Ablations on seeds 0-9 point at the head's scale acting through unnormalized advantages
(a fresh head at the right scale is harmless; normalizing the advantages or removing the bootstrapped share
of the head, lambda 1, each removes only part of the failures): the damage is mostly the variance of a huge
state-dependent baseline (V(s_t) differs between the sampled prefixes, so R - V(s_t) ranks answers by the
head, not by the reward), not a systematic bias. With two valid moves per step after onset the reward signal
beat every critic error tried, hence the single move.

Settings chosen on seeds 0-9 only (the world, lambda 0.9, unnormalized advantages, the 90-iteration budget,
the scale 30). Disclosure: seeds 100-109 were run twice, once under earlier settings (lambda 0.5) that had
already failed the bar on seeds 0-9, and once with the final settings; nothing was changed after the final
run on seeds 100-109.

Detector: `value_error` above 1.5, chosen on seeds 100-109 only, where it separates the injected branch at
onset from the healthy phase and the control.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from stabench.baselines.token_ppo import PrefixCritic, TokenPPO, TokenPPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import DiagnosedRun
from stabench.tasks.worlds.tokens import (
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
MOVES_AFTER = (3,)  # the one valid move from onset on, in both branches

# --- The policy, the critic and the trainer. --------------------------------------------------------------
MODEL = {"n_embd": 32, "n_layer": 1, "n_head": 2}
CRITIC_WIDTH = 32
CRITIC_SCALE = 30.0  # the injected value head's output scale (the healthy head's is 1)
RESET_SEED_OFFSET = 7919  # the injected head's init is seeded by seed + this offset
PPO_CONFIG = TokenPPOConfig(
    n_answers=64, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=3e-3, critic_lr=3e-3, gamma=1.0,
    gae_lambda=0.9, epochs=2, minibatches=1, clip_coef=0.2, vf_coef=0.5, ent_coef=0.0, norm_adv=False,
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

    The same distribution as `tasks.worlds.tokens.sample_answers` (inverse CDF, one uniform of `rng` per answer and
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

    onset: int | None = None  # overrides the quick and full tiers' onset iteration (checked by `Task`)
    critic_scale: float = CRITIC_SCALE  # output scale of the value head installed at onset (injected branch)

    def check(self, shortest_run: int) -> None:
        """Raise StabenchError, naming the knob, for a critic scale the task cannot run with."""
        value = self.critic_scale
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StabenchError(f"value-cold-start: knob critic_scale must be a number, got {value!r}")
        if not (math.isfinite(self.critic_scale) and self.critic_scale > 0):
            raise StabenchError(f"value-cold-start: critic_scale must be a finite number > 0, got {self.critic_scale}")


# --- One run. ----------------------------------------------------------------------------------------------
class ValueColdStartRun(DiagnosedRun):
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

    def train(self, injected: bool) -> tuple[dict[str, float], TrainState]:
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
            "policy_loss": state.extras["loss_terms"].get("policy", math.nan),  # the last update's, as minimized
            "value_loss": state.extras["loss_terms"].get("value", math.nan),
        }
        return row, state


class ValueColdStart(Task):
    """See the module docstring."""

    id = "value-cold-start"
    family = "reasoning"
    version = "2"
    trainer = "token-ppo"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=90, onset=5, seeds=5),
        "full": Budget(iterations=180, onset=5, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=FAIL_BELOW, fails_when="below", reduce="tail_mean",
                               tail=0.25)
    matched_fix = "critic-warmup"
    methods = ("baseline", "critic-warmup", "entropy-bonus")
    # The critic's RMSE on the batch: a healthy critic's is the spread of returns given a prefix; right after the
    # task switch the old critic reads more, a mis-scaled head several times that. Chosen on seeds 100-109 only.
    detector = DetectorSpec(metric="value_error", threshold=1.5)
    diagnostics = ("value_fit",)
    return_floor = 0.0629  # frozen-at-onset's mean post-onset return, seeds 0-9 (quick tier)
    return_ceiling = 0.6241  # the baseline control's mean post-onset return, seeds 0-9 (quick tier)
    knobs_type = Knobs
    experimental = True  # seeds 100-109 miss the bar (results/calibration.md)
    environments = {"stabench/ValueColdStart-v0": "ChainEnv"}
    figures = ()
    paper = """On value-cold-start the rule of a token walk changes at onset in both branches, and in the injected
branch the critic is replaced by a freshly initialized value head whose output is 30 times too large, as when a
new value head is bolted on. With advantages that are not normalized, the head's errors drive the policy for as
long as they stay large, so the baseline learns the new rule late rather than never: {failed:baseline} baseline
runs fail on the calibration seeds (fresh seeds: results/calibration.md). Warming the new head up on Monte-Carlo
returns before the policy trains again (the critic warm-up) costs a short wait and fails {failed:critic-warmup}."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> ValueColdStartRun:
        return ValueColdStartRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.critic_scale)
