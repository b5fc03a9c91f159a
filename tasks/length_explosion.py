"""length-explosion: per-sequence loss normalization pays for longer reasoning (Dr. GRPO, Liu et al. 2025).

Version 3 (a default task: it clears the calibration bar; numbers in results/calibration.md).

The world. A prompt is two digits a, b in 0..4 and a mode: 25 old problems (mode 0, answer (5 a + b) mod 10) and 25
new problems (mode 1, answer (5 a + b + 1) mod 10: a new rule). The policy writes THINK tokens (no content), then
one of 10 answers, then EOS; the rules are constrained decoding: at least 2 THINK (without a floor lengths collapse
to 0, as the prototype found), and the 12th THINK ends the chain unanswered (truncated at the reasoning budget,
reward 0), EOS after the answer. (prompt, THINK count) is the whole reasoning state, so the policy is an MLP over
(one-hot a, one-hot b, one-hot mode, one-hot THINK count) behind a causal-LM interface (`ThinkerPolicy` says why
not GPT-2: cost). Warm start: 600 full-batch Adam steps on the exact distribution of demonstrations that think 2-4
tokens and then answer the old problems right and the new ones with a uniformly random answer (they know the new
problems' format, not their rule). GRPO: 16 prompts x 16 answers, Adam lr 1e-2, one on-policy update, no KL
(beta 0), and the length-biased recipe: a BATCH-mean baseline A_i = R_i - mean_batch R, no std division,
per-sequence aggregation sum_t (.) / |o_i| (`"seq-mean"`).

Phases. Before onset (iteration 10) the batch holds old problems only, which the warm start solves. From onset the
objective in BOTH branches is the new problems: the control's batch holds 16 groups of new problems, and what it
must learn is the new rule (the policy frozen at onset answers them at chance). The injection (injected branch,
from onset): a second data source joins the batch, replayed old problems (2 of the 16 groups, the rest new
problems) whose verifier pays 5 for a right answer (`replay_scale`; the new problems' verifier pays 1): two data
sources on different reward scales behind one batch-level baseline. Nothing in either reward depends on length.
The return is the exact gold accuracy on the 25 new problems (one forward gives every prompt's stop distribution:
enumeration, no sampling), as it is the objective of both branches.

Mechanism (as measured on seeds 0-9; numbers in results/calibration.md). The replayed groups are solved, so they
hold the batch mean up (about 5 x 2 / 16 at onset against the new problems' chance 0.1): every answer on a new
problem whose reward is 0 gets A = -mean_batch R, a large negative advantage, and per-sequence normalization spreads
it over the answer's tokens, so a longer wrong answer is pushed down less per token and stopping later is favoured.
Under the baseline the new problems' chains grow to the cap within the run (mean THINK count at or near the cap of
12 at the end, most chains truncated unanswered: reward 0 whatever they would have answered), so the new rule is
not learned, while the replayed old problems stay solved. Dr. GRPO (`dr-grpo`: group-mean baseline, constant
normalization) removes both the replay's share of the baseline (a group is compared with itself) and the length
bias; its chains stay at 2-4 THINK tokens and it learns the new problems nearly as the control does: the matched
fix. Constant normalization alone (`constant-norm`) also holds the chains at 2-4, but keeps the batch-mean baseline,
under which a right answer on a new problem gets a small positive advantage: it learns, more slowly. The other named
methods, as measured: the entropy bonus (`entropy-bonus`) slows the growth (chains at 6-9 THINK tokens, a fraction
truncated) and learns part of the rule; the variance filter (`variance-filter`) drops the replayed groups (all
right) and the all-wrong new groups, which removes most of the lift but leaves the batch baseline of the mixed
groups, so chains still grow on some seeds; Markovian chunking (`markovian-chunks`) bounds the context, not the
incentive, and fails like the baseline. The control (same trainer, 16 groups of new problems, no replay) learns the
new rule; its own batch mean rises as it learns, so the same bias grows its chains too on some seeds (up to about 6
THINK tokens, up to two fifths truncated at the end), which is why its accuracy varies more than Dr. GRPO's and why
the threshold is 0.4. It sees no old problems after onset and forgets them, which the objective does not score:
prototypes that gave the control a few replayed groups on the 0-1 scale raised its batch mean enough to grow its
chains and stall it, so the control has none.

Floor and ceiling. `return_floor` = the post-onset mean return of the policy frozen at onset (chance on the new
problems), `return_ceiling` = the baseline control's post-onset mean return (the control's reach); both averaged
over seeds 0-9, measured once and fixed.

Ground truth: `gt_accuracy` (the return), failed when its mean over the last quarter of the run is below 0.4,
about halfway from the frozen policy to the control's accuracy at the end of the run; frozen and no-update
learners stay at chance. The default detector reads the sampled batch's `length_mean` (THINK + answer + EOS);
its threshold (8 tokens, CAP / 2 + 2) was chosen on version 2's seeds 100-109 and not re-chosen.

Settings and the seeds they were chosen on: the design (replayed solved problems raising a batch-mean baseline,
from the recipe measured on the previous world) and its cost-reducing changes (10 answers instead of 25, 16 x 16
answers per batch, 2 replayed groups paid 5 instead of many paid 1, quick tier 100 iterations with onset 10) on
prototype seeds 0-2; the failure threshold 0.4, the floor and the ceiling on seeds 0-9; `dr-grpo` is the named
matched fix, chosen on seeds 0-9 over `constant-norm` (which learns too slowly under the batch baseline to clear
the threshold reliably). Version 2 (corrupted references on three quarters of the old prompts) missed the bar:
what the prompts that paid nothing lost no learner could relearn, so the baseline and the fixes were not
separated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pandas as pd
import torch
from stabench.baselines.grpo import GRPO, GRPOConfig
from stabench.baselines.models import SameWeights
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, StabenchError, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import DiagnosedRun
from stabench.suite.figures import need, side_by_side
from stabench.tasks.worlds.tokens import WarmStart, answer_logits, on_default_device
from torch import nn

# --- The world: prompt = two digits and a mode; the answer, after some THINK tokens, one of 10 values. -------
N_DIGITS = 5  # a, b in 0..4
N_OLD = N_DIGITS**2  # the old problems: prompt id 5 a + b (mode 0)
N_PROMPTS = 2 * N_OLD  # prompt id = 25 mode + 5 a + b; mode 1: the new problems, asked from onset
N_ANSWERS = 10  # possible answers: a random answer is right 10% of the time
THINK = 0  # carries no content: the number of THINK tokens so far is the whole reasoning state
EOS = N_ANSWERS + 1  # follows the answer (forced)
N_ACTIONS = N_ANSWERS + 2  # THINK, answers 1..25 (token d + 1 is answer d), EOS
BOS = N_ACTIONS  # the special token: prompts are [BOS, a + 1, b + 1, mode + 1]
CAP = 12  # the CAP-th THINK token ends the chain unanswered (truncated: EOS forced, reward 0)
FLOOR = 2  # at least FLOOR THINK tokens (without a floor the lengths collapse to 0, as the prototype found)
ANSWER_LEN = CAP + 2  # THINK^k, answer, EOS (or THINK^CAP, EOS), padded with EOS
NEW_SHIFT = 1  # old rule: (5 a + b) mod 10; the new problems' rule: (5 a + b + NEW_SHIFT) mod 10

# --- The policy and the trainer. ---------------------------------------------------------------------------
HIDDEN = 64
WARM_SEED, WARM_STEPS, WARM_LR = 0, 600, 1e-2
WARM_THINK = (2, 4)  # warm-start demonstrations think 2-4 tokens, then answer (see `demonstration_targets`)
N_GROUPS = 16  # prompts (groups) per iteration, in both branches and before onset
GROUP_SIZE = 16  # answers per prompt
GRPO_CONFIG = GRPOConfig(
    n_groups=N_GROUPS, group_size=GROUP_SIZE, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=1e-2, beta=0.0,
    baseline="batch", std_normalize=False, aggregation="seq-mean", eos_id=EOS,
)  # fmt: skip


# --- Rewards: the environment and the trainer both call these. --------------------------------------------
ALL_PROMPTS = torch.tensor(
    [[BOS, a + 1, b + 1, m + 1] for m in range(2) for a in range(N_DIGITS) for b in range(N_DIGITS)]
)
PROMPT_LEN = ALL_PROMPTS.shape[1]
_A, _B, _M = ALL_PROMPTS[:, 1] - 1, ALL_PROMPTS[:, 2] - 1, ALL_PROMPTS[:, 3] - 1
GOLD = (N_DIGITS * _A + _B + NEW_SHIFT * _M) % N_ANSWERS  # old: (5 a + b) mod 10; new: (5 a + b + 1) mod 10
NEW = _M == 1


def prompt_ids(prompts: torch.Tensor) -> torch.Tensor:
    """Prompt id 25 mode + 5 a + b of prompts [B, 4] = [BOS, a + 1, b + 1, mode + 1]."""
    return (prompts[:, 3] - 1) * N_OLD + (prompts[:, 1] - 1) * N_DIGITS + (prompts[:, 2] - 1)


def parse(answers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(THINK count before the first non-THINK token, the answer or -1 if none) of answers [B, L]."""
    thinking = (answers == THINK).long().cumprod(1)
    n_think = thinking.sum(1)
    first = answers.gather(1, n_think.clamp_max(answers.shape[1] - 1)[:, None]).squeeze(1)
    valid = (n_think < answers.shape[1]) & (first >= 1) & (first <= N_ANSWERS)
    return n_think, torch.where(valid, first - 1, torch.full_like(first, -1))


class Reference:
    """The reward: `scale[id]` if the answer is `gold[id]` after FLOOR to CAP THINK tokens, else 0. `Reference()`
    pays 1 for a right answer on every prompt; the injected branch's replayed old problems pay REPLAY_SCALE."""

    def __init__(self, gold: torch.Tensor = GOLD, scale: torch.Tensor | None = None) -> None:
        self.gold = gold
        self.scale = torch.ones(N_PROMPTS) if scale is None else scale

    def __call__(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        n_think, answer = parse(answers)
        ids = prompt_ids(prompts)
        right = (answer == self.gold[ids]) & (n_think >= FLOOR) & (n_think < CAP)
        return right.float() * self.scale[ids]


gold_reward = Reference()  # 1 for a right answer on every prompt


class LengthExplosionEnv(gym.Env):
    """Answer a prompt (a, b, mode) after thinking: THINK (action 0) adds a reasoning token, d + 1 answers d.

    Observation: (a, b, mode, THINK count). An answer ends the episode with the task reward (1 if right; an old
    problem pays `replay_scale` instead, the injection's verifier scale); the CAP-th THINK ends it unanswered
    (reward 0, truncated). Prompts
    are drawn uniformly from `ids` (default: all 50, the post-onset mix of old and new problems).
    """

    metadata = {"render_modes": []}

    def __init__(self, replay_scale: float = 1.0, ids: tuple[int, ...] | None = None) -> None:
        self.reward_fn = Reference(GOLD, torch.where(NEW, 1.0, float(replay_scale)))
        self.ids = tuple(range(N_PROMPTS)) if ids is None else tuple(ids)
        self.observation_space = gym.spaces.MultiDiscrete(np.array([N_DIGITS, N_DIGITS, 2, CAP + 1], dtype=np.int64))
        self.action_space = gym.spaces.Discrete(N_ANSWERS + 1)
        self._prompt, self._tokens = ALL_PROMPTS[0], []

    def _obs(self, count: int | None = None) -> np.ndarray:
        n = len(self._tokens) if count is None else count
        return np.array([*(self._prompt[1:] - 1).tolist(), n], dtype=np.int64)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._prompt = ALL_PROMPTS[self.ids[int(self.np_random.integers(len(self.ids)))]]
        self._tokens = []
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not THINK (0) or an answer 1..{N_ANSWERS}")
        self._tokens.append(int(action))
        if int(action) == THINK:
            return self._obs(), 0.0, False, len(self._tokens) >= CAP, {}
        answer = torch.tensor([self._tokens + [EOS]])
        reward = float(self.reward_fn(self._prompt[None], answer)[0])
        return self._obs(len(self._tokens) - 1), reward, True, False, {}


STATE_FEATURES = torch.cat(
    [
        nn.functional.one_hot(_A, N_DIGITS).repeat_interleave(CAP + 1, 0),
        nn.functional.one_hot(_B, N_DIGITS).repeat_interleave(CAP + 1, 0),
        nn.functional.one_hot(_M, 2).repeat_interleave(CAP + 1, 0),
        nn.functional.one_hot(torch.arange(CAP + 1), CAP + 1).repeat(N_PROMPTS, 1),
    ],
    1,
).float()  # [50 * (CAP + 1), 2 * 5 + 2 + CAP + 1]: one-hot a, b, mode, THINK count


# --- The policy: an MLP over the sufficient statistics, behind a causal-LM interface. ---------------------
def allowed_table() -> torch.Tensor:
    """The rules as a mask [CAP + 2, N_ACTIONS + 1] over states: THINK count 0..CAP, then "answered"."""
    allowed = torch.zeros(CAP + 2, N_ACTIONS + 1, dtype=torch.bool)
    count = torch.arange(CAP + 1)
    allowed[: CAP + 1, THINK] = count < CAP
    allowed[: CAP + 1, 1 : N_ANSWERS + 1] = ((count >= FLOOR) & (count < CAP))[:, None]
    allowed[CAP, EOS] = True  # truncated: the chain ends unanswered
    allowed[CAP + 1, EOS] = True
    return allowed


ALLOWED = allowed_table()


class ThinkerPolicy(nn.Module):
    """A causal LM over [BOS, a, b, mode, answer tokens] whose logits at each position come from an MLP over
    the sufficient statistics of the prefix: one-hot a, one-hot b, one-hot mode and one-hot *visible* THINK count.

    Why not the tiny GPT-2: `GRPO.iterate` samples token by token without a KV cache; with 14 answer tokens
    that costs ~28 ms per batch of 64 on one CPU thread (measured), ~40 ms per iteration with the update,
    i.e. ~14 s for a quick trial against a 3 s budget. THINK carries no content, so (prompt, THINK count)
    is the whole state: the MLP loses nothing a transformer could use here. It is evaluated once per call
    on all 50 x (CAP + 1) states and read as a table (memoized between optimizer steps while no gradient
    is being recorded, i.e. during sampling).

    The environment's rules are constrained decoding on top of the network (forced tokens get log-prob 0
    and no gradient): THINK below FLOOR, EOS at CAP (truncated, unanswered), EOS after the answer. `bound_context(chunk,
    carry)` makes the network see a Markovian context (Delethink, Aghajohari et al. 2025): the first chunk
    holds `chunk` THINK tokens; after it the context is reset to the prompt plus the last `carry` tokens,
    so the visible count is carry + (count - chunk) mod (chunk - carry). The rules still read the true count.
    """

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2 * N_DIGITS + 2 + CAP + 1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, N_ANSWERS + 1),
        )  # fmt: skip
        self.chunk: int | None = None
        self.carry = 0
        self._memo: tuple[tuple[int, ...], torch.Tensor] | None = None
        # vocab_size and n_positions as a causal LM's config states them (tokens 0..BOS, prompt ++ answer), so that
        # stabilizers that size a model on the policy's (the per-token critics of `mini-critics`) can read them
        self.config = SimpleNamespace(
            bos_token_id=BOS,
            to_dict=lambda: {"kind": "thinker-mlp", "hidden": hidden, "cap": CAP, "floor": FLOOR,
                             "vocab_size": BOS + 1, "n_positions": PROMPT_LEN + ANSWER_LEN},
        )

    def bound_context(self, chunk: int, carry: int) -> None:
        if not 0 <= carry < chunk:
            raise StabenchError(f"markovian context needs 0 <= carry < chunk, got chunk {chunk}, carry {carry}")
        self.chunk, self.carry = chunk, carry
        self._memo = None

    def visible(self, count: torch.Tensor) -> torch.Tensor:
        """The THINK count the network sees: the true count, or its Markovian (chunked) reading."""
        if self.chunk is None:
            return count
        later = self.carry + (count - self.chunk) % (self.chunk - self.carry)
        return torch.where(count < self.chunk, count, later)

    def state_logits(self) -> torch.Tensor:
        """Logits [50, CAP + 2, N_ACTIONS + 1] of every (prompt, state), the rules applied."""
        key = tuple(p._version for p in self.parameters())
        if not torch.is_grad_enabled() and self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        net = self.net(STATE_FEATURES).view(N_PROMPTS, CAP + 1, N_ANSWERS + 1)[:, self.visible(torch.arange(CAP + 1))]
        logits = torch.cat([net, torch.zeros(N_PROMPTS, CAP + 1, 2)], -1)  # EOS, BOS
        logits = torch.cat([logits, torch.zeros(N_PROMPTS, 1, N_ACTIONS + 1)], 1).masked_fill(~ALLOWED, -1e9)
        if not torch.is_grad_enabled():
            self._memo = (key, logits)
        return logits

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        run = (input_ids[:, PROMPT_LEN:] == THINK).long().cumprod(1)  # 1 while the answer so far is all THINK
        state = torch.cat([torch.zeros_like(input_ids[:, :PROMPT_LEN]), run.cumsum(1)], 1)  # THINK count so far
        state[:, PROMPT_LEN:].masked_fill_(run == 0, CAP + 1)  # answered
        return SimpleNamespace(logits=self.state_logits()[prompt_ids(input_ids)[:, None], state])


def demonstration_targets() -> tuple[torch.Tensor, torch.Tensor]:
    """The warm start's data in closed form: (visit weight [CAP + 1], target [50, CAP + 1, 11] over THINK, answers).

    Demonstrations think k ~ uniform(WARM_THINK) tokens, then write the gold answer on an old problem and a
    uniformly random answer on a new one (the warm start knows their format, not their rule). At a count c inside
    WARM_THINK they are there with probability P(k >= c) and stop with probability 1 / (hi - c + 1).
    """
    lo, hi = WARM_THINK
    count = torch.arange(CAP + 1, dtype=torch.float32)
    free = (count >= lo) & (count <= hi)
    visit = torch.where(free, (hi - count + 1) / (hi - lo + 1), torch.zeros(()))
    stop = torch.where(free, 1 / (hi - count + 1).clamp_min(1), torch.zeros(()))
    target = torch.zeros(N_PROMPTS, CAP + 1, N_ANSWERS + 1)
    target[..., THINK] = 1 - stop
    target[NEW, :, 1:] = (stop / N_ANSWERS)[None, :, None]  # the new problems' format, not their rule
    old = torch.arange(N_OLD)
    target[old, :, GOLD[old] + 1] = stop
    return visit, target


def _warm_up() -> ThinkerPolicy:
    """Full-batch supervised steps on the exact demonstration distribution (no sampling: cheap, deterministic)."""
    with torch.random.fork_rng():
        torch.manual_seed(WARM_SEED)
        model = ThinkerPolicy()
    optimizer = torch.optim.Adam(model.parameters(), lr=WARM_LR)
    visit, target = demonstration_targets()
    for _ in range(WARM_STEPS):
        logp = torch.log_softmax(model.net(STATE_FEATURES).view(N_PROMPTS, CAP + 1, N_ANSWERS + 1), -1)
        loss = -((target * logp).sum(-1) * visit).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


# The RL start: the policy after the warm-up (deterministic: its own seeds, one thread; shipped as
# tasks/warm_starts/length-explosion.safetensors).
warm_policy = WarmStart("length-explosion", _warm_up, ThinkerPolicy,
                        sha256="3e49b38bb6235a1426dd89e0d747f6cf5819616c5e306d99a6bcf2b5604e7125")


# --- Exact quantities: the THINK count is the whole state, so one forward per prompt gives everything. ----
@torch.no_grad()
def exact_behaviour(model: nn.Module, gold: torch.Tensor = GOLD) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expected THINK count [50], probability of the answer `gold` [50], probability of truncation at the cap
    [50]) of every prompt under the policy."""
    thinks = torch.full((N_PROMPTS, CAP + 1), THINK, dtype=torch.long)
    probs = torch.softmax(answer_logits(model, ALL_PROMPTS, thinks, N_ACTIONS).double(), -1)  # [50, CAP + 1, A]
    reach = torch.cat([torch.ones(N_PROMPTS, 1, dtype=probs.dtype), probs[:, :-1, THINK].cumprod(1)], 1)
    stop = reach * (1 - probs[..., THINK])  # P(answer after exactly c THINK tokens)
    mean_think = (stop * torch.arange(CAP + 1, dtype=probs.dtype)).sum(1)
    right = (reach * probs.gather(-1, (gold + 1).view(-1, 1, 1).expand(-1, CAP + 1, 1)).squeeze(-1)).sum(1)
    return mean_think, right, reach[:, CAP]


# --- Knobs. ------------------------------------------------------------------------------------------------
REPLAY_GROUPS = 2  # injected branch, from onset: groups of the (solved) old problems in each batch
REPLAY_SCALE = 5.0  # ... whose verifier pays a right answer REPLAY_SCALE (the new problems' pays 1)


@dataclass(frozen=True)
class Knobs:
    """Keyword arguments of `LengthExplosion`."""

    onset: int | None = None  # overrides the quick and full tiers' onset iteration (`Task` checks it)
    replay_scale: float = REPLAY_SCALE  # what the replayed old problems' verifier pays for a right answer

    def check(self, shortest_run: int) -> None:
        scale = self.replay_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise StabenchError(f"length-explosion: replay_scale must be a positive number, got {scale!r}")


# --- One run. ----------------------------------------------------------------------------------------------
class LengthExplosionRun(DiagnosedRun):
    """One seed under one method: the GRPO trainer (policy, optimizer, sampler) and the prompt sampler."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 replay_scale: float) -> None:  # fmt: skip
        self.budget, self.diagnostics = budget, diagnostics
        self.rng = np.random.default_rng([seed, 1])  # prompts; the trainer has its own
        self.mixed_reward = Reference(GOLD, scale=torch.where(NEW, 1.0, float(replay_scale)))
        config = replace(GRPO_CONFIG, seed=seed)
        self.trainer = GRPO(warm_policy(), warm_policy(), gold_reward, config, stabilizer)
        self.evaluate = SameWeights()  # the exact behaviour, computed again only when the policy changed

    def prompts(self, injected: bool) -> torch.Tensor:
        """The batch's prompt ids: old problems before onset; from onset new ones, REPLAY_GROUPS of them
        replaced by old ones in the injected branch."""
        post = self.trainer.iteration >= self.budget.onset
        n_old = (REPLAY_GROUPS if injected else 0) if post else N_GROUPS
        old = self.rng.integers(0, N_OLD, n_old)
        new = N_OLD + self.rng.integers(0, N_OLD, N_GROUPS - n_old)
        return on_default_device(np.concatenate([old, new]))

    def train(self, injected: bool) -> tuple[dict[str, float], TrainState]:
        post = self.trainer.iteration >= self.budget.onset
        reward = self.mixed_reward if post and injected else gold_reward
        state = self.trainer.iterate(reward, ALL_PROMPTS[self.prompts(injected)])
        policy = self.trainer.policy
        context = (getattr(policy, "chunk", None), getattr(policy, "carry", None))  # markovian-chunks sets it
        mean_think, right, capped = self.evaluate(exact_behaviour, policy, key=context)
        asked = NEW if post else ~NEW  # the phase's objective: the new problems from onset
        new_groups = state.batch["prompts"][:, 3] == 2
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": float(right[asked].mean()),
            "entropy": state.extras["entropy"],
            "gt_accuracy": float(right[asked].mean()),  # exact gold accuracy on the phase's problems
            "gt_acc_old": float(right[~NEW].mean()),
            "gt_acc_new": float(right[NEW].mean()),
            "gt_think_mean": float(mean_think[asked].mean()),
            "gt_think_old": float(mean_think[~NEW].mean()),
            "gt_think_new": float(mean_think[NEW].mean()),
            "gt_capped": float(capped[asked].mean()),  # probability that a chain is truncated unanswered
            "reward": float(state.batch["rewards"].mean()),
            "reward_new": float(state.batch["rewards"][new_groups].mean()) if bool(new_groups.any()) else 0.0,
        }
        return row, state


def fig_length(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Length beside exact gold accuracy: chains that grow without accuracy gain are the failure."""
    rows = need(table, "length-explosion", "length_mean", "gt_accuracy")
    rows = rows[(rows["variant"] == "injected") & rows["role"].isin(["baseline", "matched-fix"])]
    panels = [("length_mean", "mean answer length [tokens]"), ("gt_accuracy", "exact gold accuracy")]
    return side_by_side(rows, panels, "method", "length-explosion, injected runs", out, name)


class LengthExplosion(Task):
    """See the module docstring."""

    id = "length-explosion"
    family = "reasoning"
    version = "3"
    experimental = False
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=100, onset=10, seeds=5),
        "full": Budget(iterations=200, onset=10, seeds=10),
    }
    # Failure: the exact gold accuracy on the 25 new problems, averaged over the last quarter of the run, below 0.4.
    ground_truth = GroundTruth(metric="gt_accuracy", threshold=0.4, fails_when="below", reduce="tail_mean")
    provides = frozenset({"bound_context"})
    matched_fix = "dr-grpo"
    methods = ("baseline", "dr-grpo", "constant-norm", "entropy-bonus", "variance-filter", "markovian-chunks")
    detector = DetectorSpec(metric="length_mean", threshold=CAP / 2 + 2)  # tokens, answer and EOS incl.; v2 chose it
    diagnostics = ("lengths",)
    # Floor: the policy frozen at onset, its post-onset mean return (exact new-problem accuracy, chance); ceiling: the
    # baseline's control, its post-onset mean return; both averaged over calibration seeds 0-9 (measured once, fixed).
    return_floor = 0.1004
    return_ceiling = 0.584
    knobs_type = Knobs
    environments = {"stabench/LengthExplosion-v0": "LengthExplosionEnv"}
    figures = (
        Figure("length-accuracy", "reasoning length and accuracy",
               "Mean answer length and exact gold accuracy on the new problems of length-explosion, baseline and "
               "Dr. GRPO.", fig_length),
    )  # fmt: skip
    paper = """On length-explosion the policy writes content-free reasoning tokens before it answers one of 10 values;
from onset it must learn new problems with a new rule. In the injected branch the batch also holds replayed,
already-solved old problems whose verifier pays on a larger scale: two data sources behind one batch-mean baseline.
The replay holds the batch mean up, so every wrong answer on a new problem gets a negative advantage; normalized per
sequence, that push is diluted by length, so longer wrong answers are favoured and the new problems' chains grow
to the reasoning budget, truncated unanswered, and the new rule is not learned. Dr. GRPO (group baseline, constant
normalization) learns the new problems as the control does; constant normalization alone holds the chains but
learns slowly under the batch baseline (figure below)."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> LengthExplosionRun:
        return LengthExplosionRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.replay_scale)
