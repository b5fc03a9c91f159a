"""length-explosion: per-sequence loss normalization pays for longer reasoning (Dr. GRPO, Liu et al. 2025).

EXPERIMENTAL (version 2): the post-onset phase demands learning, but the bar is not met (why below; the measured
numbers are in results/calibration.md).

The world. A prompt is two digits a, b in 0..4 and a mode: 25 old problems (mode 0, answer (a + b) mod 5) and 25
new problems (mode 1, answer (a + b + 1) mod 5: a new rule). The policy writes THINK tokens (no content), then one
digit, then EOS; the rules are constrained decoding: at least 2 THINK (without a floor lengths collapse to 0, as
the prototype found), and the 12th THINK ends the chain unanswered (truncated at the reasoning budget, reward 0),
EOS after the digit. (prompt, THINK count) is the whole reasoning state, so the policy is an MLP over (one-hot a,
one-hot b, one-hot mode, one-hot THINK count) behind a causal-LM interface (`ThinkerPolicy` says why not GPT-2:
cost). Warm start: 200 full-batch Adam steps on the exact distribution of demonstrations that think 2-4 tokens and
then answer the old problems right and the new ones with a uniformly random digit (they know the new problems'
format, not their rule). GRPO: 12 prompts x 8 answers, Adam lr 1e-2, one on-policy update, no KL (beta 0), and the
length-biased recipe of the prototypes: a BATCH-mean baseline A_i = R_i - mean_batch R, no std division,
per-sequence aggregation sum_t (.) / |o_i| (`"seq-mean"`).

Phases. Before onset the prompts are the old problems only. From onset, in BOTH branches, prompts are drawn from
all 50 and the new problems pay for the new rule: that is what the learner must learn. The injection (injected
branch, from onset): 75% of the OLD prompt ids (19 of 25, fixed per seed) get a corrupted reference, reward 0
whatever the answer. Nothing in the reward depends on length. The return is the exact gold accuracy (one forward
gives every prompt's stop distribution) over the phase's problems: the old ones before onset, all 50 from onset
(the corrupted prompts are graded by their true rule).

Mechanism. Baseline: on a corrupted prompt every answer gets A = -b < 0 (b = mean_batch R) and its tokens the
weight 1 / |o_i|, so stopping later is pushed down less: the old problems' chains grow toward the cap, some are
truncated unanswered, and the old problems' accuracy falls while the new problems are learned. Constant
normalization of the policy term (`constant-norm`) holds the chains and learns the new problems, but the old
problems' accuracy still falls: the corrupted prompts pay nothing, so nothing holds their answers while the shared
a, b features move to the new rule (and the batch baseline pushes down whatever is sampled on them). Dr. GRPO
(`dr-grpo`: group-mean baseline, so corrupted groups get A = 0) holds the chains too. Markovian chunking
(`markovian-chunks`) does not hold them; the entropy bonus (`entropy-bonus`) is the plain guard.

Why the bar is not met. The length bias of a batch-mean baseline lands on the prompts whose reward is below the
batch mean (Sum_i A_i = 0: with all prompts alike it cancels), i.e. on the prompts that pay nothing; what they
lose (their old answers, truncated) no learner can relearn there, and a policy frozen at onset keeps it. So the
learning the task asks for (the new problems) is done by the baseline too, and the gap between the baseline and
the fixes is the old problems' accuracy, which the fixes also lose in part through the shared features: their
return intervals are not clear of the baseline's. The control is also slow to learn the new rule (short of the
bar's 0.8 normalized return). Not measured, the next candidate: make the prompts that pay nothing the ones to
learn, i.e. hard new problems that fail until solved, whose chains the bias drives to the cap (truncated, so never
solved) when easy prompts hold the batch mean up. Tried on seeds 0-2 (quick) and rejected: the new rule on the
uncorrupted old prompts (the learners' old-prompt accuracy falls below the frozen policy's through the shared
features, and the baseline's chains do not grow while the new rule is unsolved); the new rule on all 25 prompts
(learning too slow); a mediocre warm start to improve on, with onset 10 (the onset policy is already near the
target, and the fixes' corrupted prompts fall below the frozen policy); separate digit tokens for the new problems
(no transfer: the new rule is not learned); lr 5e-3 (slow) and 2e-2 (unstable); 200 iterations (seeds 0-9: no
better than 150).

Floor and ceiling. `return_floor` = the exact post-onset accuracy of the policy frozen at onset, averaged over
seeds 0-9 (measured once, fixed); `return_ceiling` = 1, the post-onset optimum (every prompt right, no chain
truncated).

Ground truth: the exact gold accuracy over all 50 prompts (`gt_accuracy`, the return), failed when its mean over
the last quarter of the run is below 0.8, about halfway from the frozen policy to the optimum; frozen and no-update
learners stay at the floor. The default detector reads the sampled batch's `length_mean` (THINK + digit + EOS);
its threshold (8 tokens, CAP / 2 + 2) was chosen on seeds 100-109 only. Settings (quick tier: 150 iterations,
onset 30) chosen on seeds 0-2 and 0-9; `constant-norm` is the named matched fix for the best return, with
`dr-grpo`, on seeds 0-9.
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
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.suite.figures import need, side_by_side
from stabench.tasks.worlds.tokens import WarmStart, answer_logits, on_default_device
from torch import nn

# --- The world: prompt = two digits and a mode; the answer, after some THINK tokens, a sum mod 5. ----------
N_DIGITS = 5
N_OLD = N_DIGITS**2  # the old problems: prompt id 5 a + b (mode 0)
N_PROMPTS = 2 * N_OLD  # prompt id = 25 mode + 5 a + b; mode 1: the new problems, asked from onset
THINK = 0  # carries no content: the number of THINK tokens so far is the whole reasoning state
EOS = N_DIGITS + 1  # follows the answer digit (forced)
N_ACTIONS = N_DIGITS + 2  # THINK, digits 1..5 (token d + 1 is digit d), EOS
BOS = N_ACTIONS  # the special token: prompts are [BOS, a + 1, b + 1, mode + 1]
CAP = 12  # the CAP-th THINK token ends the chain unanswered (truncated: EOS forced, reward 0)
FLOOR = 2  # at least FLOOR THINK tokens (without a floor the lengths collapse to 0, as the prototype found)
ANSWER_LEN = CAP + 2  # THINK^k, digit, EOS (or THINK^CAP, EOS), padded with EOS
CORRUPTED_SHARE = 0.75  # share of the OLD prompt ids whose reference is corrupted from onset (fixed per seed)
NEW_SHIFT = 1  # the new problems' rule: (a + b + NEW_SHIFT) mod 5

# --- The policy and the trainer. ---------------------------------------------------------------------------
HIDDEN = 64
WARM_SEED, WARM_STEPS, WARM_LR = 0, 200, 1e-2
WARM_THINK = (2, 4)  # warm-start demonstrations think 2-4 tokens, then answer (see `demonstration_targets`)
GRPO_CONFIG = GRPOConfig(
    n_groups=12, group_size=8, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=1e-2, beta=0.0,
    baseline="batch", std_normalize=False, aggregation="seq-mean", eos_id=EOS,
)  # fmt: skip


# --- Rewards: the environment and the trainer both call these. --------------------------------------------
ALL_PROMPTS = torch.tensor(
    [[BOS, a + 1, b + 1, m + 1] for m in range(2) for a in range(N_DIGITS) for b in range(N_DIGITS)]
)
PROMPT_LEN = ALL_PROMPTS.shape[1]
_A, _B, _M = ALL_PROMPTS[:, 1] - 1, ALL_PROMPTS[:, 2] - 1, ALL_PROMPTS[:, 3] - 1
GOLD = (_A + _B + NEW_SHIFT * _M) % N_DIGITS  # old problems: (a + b) mod 5; new: (a + b + NEW_SHIFT) mod 5
NEW = _M == 1


def prompt_ids(prompts: torch.Tensor) -> torch.Tensor:
    """Prompt id 25 mode + 5 a + b of prompts [B, 4] = [BOS, a + 1, b + 1, mode + 1]."""
    return (prompts[:, 3] - 1) * N_OLD + (prompts[:, 1] - 1) * N_DIGITS + (prompts[:, 2] - 1)


def parse(answers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(THINK count before the first non-THINK token, the answer digit or -1 if none) of answers [B, L]."""
    thinking = (answers == THINK).long().cumprod(1)
    n_think = thinking.sum(1)
    first = answers.gather(1, n_think.clamp_max(answers.shape[1] - 1)[:, None]).squeeze(1)
    valid = (n_think < answers.shape[1]) & (first >= 1) & (first <= N_DIGITS)
    return n_think, torch.where(valid, first - 1, torch.full_like(first, -1))


class Reference:
    """The reward: 1 if the answer digit is `gold[id]` after FLOOR to CAP THINK tokens and the prompt id is
    `paid`, else 0. `Reference()` is the pre-onset task: the old rule everywhere, every prompt paid."""

    def __init__(self, gold: torch.Tensor = GOLD, paid: torch.Tensor | None = None) -> None:
        self.gold = gold
        self.paid = torch.ones(N_PROMPTS, dtype=torch.bool) if paid is None else paid

    def __call__(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        n_think, digit = parse(answers)
        ids = prompt_ids(prompts)
        right = (digit == self.gold[ids]) & (n_think >= FLOOR) & (n_think < CAP)
        return (right & self.paid[ids]).float()


gold_reward = Reference()  # the pre-onset task: (a + b) mod 5 on every prompt


class LengthExplosionEnv(gym.Env):
    """Answer a prompt (a, b, mode) after thinking: THINK (action 0) adds a reasoning token, d + 1 answers d.

    Observation: (a, b, mode, THINK count). An answer ends the episode with the task reward (0 on a corrupted
    prompt id when `corrupted` is given); the CAP-th THINK ends it unanswered (reward 0, truncated). Prompts
    are drawn uniformly from `ids` (default: all 50, the post-onset mix of old and new problems).
    """

    metadata = {"render_modes": []}

    def __init__(self, corrupted: tuple[int, ...] = (), ids: tuple[int, ...] | None = None) -> None:
        bad = torch.zeros(N_PROMPTS, dtype=torch.bool)
        bad[list(corrupted)] = True
        self.reward_fn = Reference(GOLD, ~bad)
        self.ids = tuple(range(N_PROMPTS)) if ids is None else tuple(ids)
        self.observation_space = gym.spaces.MultiDiscrete(np.array([N_DIGITS, N_DIGITS, 2, CAP + 1], dtype=np.int64))
        self.action_space = gym.spaces.Discrete(N_DIGITS + 1)
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
            raise ValueError(f"action {action!r} is not THINK (0) or an answer 1..{N_DIGITS}")
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
    allowed[: CAP + 1, 1 : N_DIGITS + 1] = ((count >= FLOOR) & (count < CAP))[:, None]
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
            nn.Linear(hidden, N_DIGITS + 1),
        )  # fmt: skip
        self.chunk: int | None = None
        self.carry = 0
        self._memo: tuple[tuple[int, ...], torch.Tensor] | None = None
        self.config = SimpleNamespace(
            bos_token_id=BOS, to_dict=lambda: {"kind": "thinker-mlp", "hidden": hidden, "cap": CAP, "floor": FLOOR}
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
        net = self.net(STATE_FEATURES).view(N_PROMPTS, CAP + 1, N_DIGITS + 1)[:, self.visible(torch.arange(CAP + 1))]
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
    """The warm start's data in closed form: (visit weight [CAP + 1], target [50, CAP + 1, 6] over THINK, digits).

    Demonstrations think k ~ uniform(WARM_THINK) tokens, then write the gold digit on an old problem and a
    uniformly random digit on a new one (the warm start knows their format, not their rule). At a count c inside
    WARM_THINK they are there with probability P(k >= c) and stop with probability 1 / (hi - c + 1).
    """
    lo, hi = WARM_THINK
    count = torch.arange(CAP + 1, dtype=torch.float32)
    free = (count >= lo) & (count <= hi)
    visit = torch.where(free, (hi - count + 1) / (hi - lo + 1), torch.zeros(()))
    stop = torch.where(free, 1 / (hi - count + 1).clamp_min(1), torch.zeros(()))
    target = torch.zeros(N_PROMPTS, CAP + 1, N_DIGITS + 1)
    target[..., THINK] = 1 - stop
    target[NEW, :, 1:] = (stop / N_DIGITS)[None, :, None]  # the new problems' format, not their rule
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
        logp = torch.log_softmax(model.net(STATE_FEATURES).view(N_PROMPTS, CAP + 1, N_DIGITS + 1), -1)
        loss = -((target * logp).sum(-1) * visit).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


# The RL start: the policy after the warm-up (deterministic: its own seeds, one thread; cached).
warm_policy = WarmStart("length-explosion", _warm_up, ThinkerPolicy)


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
@dataclass(frozen=True)
class Knobs:
    """Keyword arguments of `LengthExplosion`."""

    onset: int | None = None  # overrides the quick and full tiers' onset iteration (`Task` checks it)
    corrupted_share: float = CORRUPTED_SHARE  # share of the old prompt ids paid 0 from onset (injected branch)

    def check(self, shortest_run: int) -> None:
        share = self.corrupted_share
        if (
            isinstance(share, bool)
            or not isinstance(share, (int, float))
            or not (math.isfinite(share) and 0 < share <= 1)
        ):
            raise StabenchError(f"length-explosion: corrupted_share must be a number in (0, 1], got {share!r}")


# --- One run. ----------------------------------------------------------------------------------------------
class LengthExplosionRun:
    """One seed under one method: the GRPO trainer (policy, optimizer, sampler) and the prompt sampler."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...],
                 corrupted_share: float) -> None:  # fmt: skip
        self.budget, self.diagnostics = budget, diagnostics
        self.rng = np.random.default_rng([seed, 1])  # prompts and the corrupted set; the trainer has its own
        n_bad = max(1, round(corrupted_share * N_OLD))
        self.corrupted = torch.zeros(N_PROMPTS, dtype=torch.bool)
        self.corrupted[self.rng.choice(N_OLD, n_bad, replace=False)] = True
        self.injected_reward = Reference(GOLD, ~self.corrupted)
        config = replace(GRPO_CONFIG, seed=seed)
        self.trainer = GRPO(warm_policy(), warm_policy(), gold_reward, config, stabilizer)

    def step(self, injected: bool) -> dict[str, float]:
        post = self.trainer.iteration >= self.budget.onset
        reward = self.injected_reward if post and injected else gold_reward
        ids = on_default_device(self.rng.integers(0, N_PROMPTS if post else N_OLD, GRPO_CONFIG.n_groups))
        state = self.trainer.iterate(reward, ALL_PROMPTS[ids])
        mean_think, right, capped = exact_behaviour(self.trainer.policy)
        asked = slice(None) if post else slice(0, N_OLD)  # the prompts of the phase's objective
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
            "gt_think_corrupted": float(mean_think[self.corrupted].mean()),
            "gt_capped": float(capped[asked].mean()),  # probability that a chain is truncated unanswered
            "reward": float(state.batch["rewards"].mean()),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


def fig_length(table: pd.DataFrame, out: Path) -> list[Path]:
    """Length beside exact gold accuracy: chains that grow without accuracy gain are the failure."""
    rows = need(table, "length-explosion", "length_mean", "gt_accuracy")
    rows = rows[(rows["variant"] == "injected") & rows["role"].isin(["baseline", "matched-fix"])]
    panels = [("length_mean", "mean answer length [tokens]"), ("gt_accuracy", "exact gold accuracy")]
    return side_by_side(rows, panels, "method", "length-explosion, injected runs", out, "06_length_accuracy")


class LengthExplosion(Task):
    """See the module docstring."""

    id = "length-explosion"
    family = "reasoning"
    version = "2"
    experimental = True  # the bar is not met: see the module docstring
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=150, onset=30, seeds=10),
        "full": Budget(iterations=300, onset=30, seeds=10),
    }
    # Failure: the exact gold accuracy over all 50 prompts, averaged over the last quarter of the run, below 0.8.
    ground_truth = GroundTruth(metric="gt_accuracy", threshold=0.8, fails_when="below", reduce="tail_mean")
    provides = frozenset({"bound_context"})
    matched_fix = "constant-norm"
    methods = ("baseline", "constant-norm", "dr-grpo", "markovian-chunks", "entropy-bonus")
    detector = DetectorSpec(metric="length_mean", threshold=CAP / 2 + 2)  # tokens incl. digit and EOS; seeds 100-109
    diagnostics = ("lengths",)
    return_floor = 0.578  # frozen at onset, exact, mean over seeds 0-9 (measured once, fixed)
    return_ceiling = 1.0  # the post-onset optimum: every prompt right, no chain truncated
    knobs_type = Knobs
    environments = {"stabench/LengthExplosion-v0": "LengthExplosionEnv"}
    figures = (
        Figure("06_length_accuracy", "reasoning length and accuracy",
               "Mean answer length and exact gold accuracy on length-explosion (experimental), baseline and constant "
               "normalization.", fig_length),
    )  # fmt: skip
    paper = """On length-explosion (experimental) the policy writes content-free reasoning tokens before it answers a
sum mod 5; from onset it must also learn new problems with a new rule, and in the injected branch three quarters of
the old problems pay nothing. With a batch-mean baseline and a loss normalized per sequence, every answer on those
prompts gets a negative advantage spread over its tokens, so a longer chain is pushed down less, and the chains grow
toward the reasoning budget, truncated unanswered. Constant normalization bounds the chains, but no fix restores
what the prompts paying nothing lose: nothing can relearn their answers there, so the baseline and the fixes are
not separated and the task stays experimental (figure below)."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> LengthExplosionRun:
        return LengthExplosionRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.corrupted_share)
