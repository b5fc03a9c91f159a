"""length-explosion: per-sequence loss normalization pays for longer reasoning (Dr. GRPO, Liu et al. 2025).

The world. A prompt is two digits a, b in 0..4 (25 prompts); the answer is (a + b) mod 5. The policy writes
THINK tokens (no content), then one digit, then EOS; the rules are constrained decoding: at least 2 THINK
(without a floor lengths collapse to 0, as the prototype found), at most 12 (then a digit is forced), EOS
forced after the digit. The THINK count is the whole reasoning state, so the policy is an MLP over (one-hot
a, one-hot b, one-hot THINK count) behind a causal-LM interface (`ThinkerPolicy` says why not GPT-2: cost).
Warm start: 200 full-batch Adam steps on the exact distribution of demonstrations that think 2-4 tokens
and then answer right (gold accuracy 0.997, mean 3.0 THINK). GRPO: 12 prompts x 8 answers, Adam lr 5e-3,
one on-policy update, no KL (beta 0), and the length-biased recipe of the prototypes: a BATCH-mean baseline
A_i = R_i - mean_batch R, no std division, per-sequence aggregation sum_t (.) / |o_i| (`"seq-mean"`).

The injection (injected branch, from onset): 75% of the prompt ids (19 of 25, fixed per seed) get a
corrupted reference: reward 0 whatever the answer. Nothing in the reward depends on length. The return and
the ground truth are computed exactly from the policy (one forward gives every prompt's stop distribution).

Mechanism, as the calibration measured it (quick tier: 120 iterations, onset 30; seeds 0-4; ranges are
per-seed means over the last quarter). After onset b = mean_batch R is about 0.28, so every answer to a
corrupted prompt gets A = -b < 0 and contributes (b / N) (1 / |o_i|) sum_t log pi(o_i,t) to the loss: the
sampled answer is pushed down, with a weight 1 / |o_i| that falls with its length. Stopping after k THINK
tokens is pushed down harder than stopping after k + 1, so the stop decisions drift to later counts until
the cap. Baseline: the corrupted prompts' expected THINK count goes from 2.2-3.2 at onset to 8.8-10.8 of 12,
the mean over all prompts to 7.4-9.1 (clean prompts 2.6-3.9), crossing 6 at 28-63 iterations after onset;
exact gold accuracy falls from 1.00 to 0.65-0.82 (nothing is gained by thinking longer: the corrupted
prompts' answers are pushed down too, and the long counts were never trained). Controls: 2.1-2.6,
accuracy 1.00. Not entropy collapse: the injected runs' entropy (0.05-0.09 nats per token, forced tokens
included) sits inside the controls' range (0.05-0.13).

Fixes, measured. Constant normalization of the policy term (`constant-norm`, the matched fix: each token
weighs 1 / (N L_max) whatever its answer's length) holds the mean THINK count at 2.4-4.4 (0/5 failures;
its controls 2.1-3.5), but gold accuracy still falls to 0.66-0.91: the batch baseline keeps pushing down
whatever is sampled on the corrupted prompts (mostly the right digit); it no longer buys length. Dr. GRPO
(`dr-grpo`: group-mean baseline plus constant normalization, so corrupted groups get A = 0) holds 2.3-3.7
and accuracy 0.89-0.98. Markovian chunking (`markovian-chunks`: chunks of 6 THINK tokens, 2 carried over,
so counts 6-12 read as 2-5) is a named NON-fix here: 5/5 failures, mean THINK 7.5-8.9 (corrupted prompts
9.3-10.9), accuracy 0.56-0.87. A bounded context bounds what the policy conditions on, not the 1 / |o|
weight: the wrapped counts share their stop decisions with the short counts of the same prompt, and the
bias pushes those later too (as the prototype found against a length bonus). The plain guard
(`token-entropy-bonus`, coefficient 0.01) fails 5/5 (8.3-9.1, accuracy 0.60-0.74).
Normalized return (exact gold accuracy; 0 = a uniform guess 0.2, 1 = always right), 95% CI: baseline
0.78 [0.74, 0.82], constant-norm 0.84 [0.77, 0.91], dr-grpo 0.94 [0.92, 0.97], markovian-chunks 0.77
[0.69, 0.85], token-entropy-bonus 0.75 [0.71, 0.79]. One quick trial (healthy phase once, both branches)
costs 2.4-3.5 CPU-seconds on one thread of a shared machine.
Full tier (300 iterations, seeds 0-1 checked): baseline 9.5-9.6 (corrupted prompts 11.9, at the cap),
markovian-chunks 9.5-9.6, controls 2.0-2.1; constant-norm holds 3.1-4.4 while its gold accuracy keeps
falling (0.55-0.57): it removes the length bias, not the batch baseline's push-down of right answers on the
corrupted prompts, which only the group-mean baseline of `dr-grpo` removes.

Ground truth: the exact expected THINK count over all 25 prompts, failed when its mean over the last quarter
of the run exceeds 6 = CAP / 2 (half the reasoning budget spent on average where the warm start spends
2-4). The default detector reads the sampled batch's `length_mean` (THINK + digit + EOS) against 8 tokens,
the same budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from baselines.grpo import GRPO, GRPOConfig
from suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from suite.diagnostics import DIAGNOSTICS
from tasks.tokens import answer_logits, on_default_device, warm_start

# --- The world: prompt = two digits, answer = their sum mod 5, after some THINK tokens. --------------------
N_DIGITS = 5
N_PROMPTS = N_DIGITS**2  # prompt id = 5 a + b
THINK = 0  # carries no content: the number of THINK tokens so far is the whole reasoning state
EOS = N_DIGITS + 1  # follows the answer digit (forced)
N_ACTIONS = N_DIGITS + 2  # THINK, digits 1..5 (token d + 1 is digit d), EOS
BOS = N_ACTIONS  # the special token: prompts are [BOS, a + 1, b + 1]
CAP = 12  # at most CAP THINK tokens, then an answer is forced
FLOOR = 2  # at least FLOOR THINK tokens (without a floor the lengths collapse to 0, as the prototype found)
ANSWER_LEN = CAP + 2  # THINK^k, digit, EOS, padded with EOS
CORRUPTED_SHARE = 0.75  # share of prompt ids whose reference is corrupted from onset (fixed per seed)

# --- The policy and the trainer. ---------------------------------------------------------------------------
HIDDEN = 64
WARM_SEED, WARM_STEPS, WARM_LR = 0, 200, 1e-2
WARM_THINK = (2, 4)  # warm-start demonstrations think 2-4 tokens, then answer right
GRPO_CONFIG = GRPOConfig(
    n_groups=12, group_size=8, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=5e-3, beta=0.0,
    baseline="batch", std_normalize=False, aggregation="seq-mean", eos_id=EOS,
)  # fmt: skip


# --- Rewards: the environment and the trainer both call these. --------------------------------------------
ALL_PROMPTS = torch.tensor([[BOS, a + 1, b + 1] for a in range(N_DIGITS) for b in range(N_DIGITS)])
GOLD = (torch.arange(N_PROMPTS) // N_DIGITS + torch.arange(N_PROMPTS) % N_DIGITS) % N_DIGITS


def prompt_ids(prompts: torch.Tensor) -> torch.Tensor:
    """Prompt id 5 a + b of prompts [B, 3] = [BOS, a + 1, b + 1]."""
    return (prompts[:, 1] - 1) * N_DIGITS + (prompts[:, 2] - 1)


def parse(answers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(THINK count before the first non-THINK token, the answer digit or -1 if none) of answers [B, L]."""
    thinking = (answers == THINK).long().cumprod(1)
    n_think = thinking.sum(1)
    first = answers.gather(1, n_think.clamp_max(answers.shape[1] - 1)[:, None]).squeeze(1)
    valid = (n_think < answers.shape[1]) & (first >= 1) & (first <= N_DIGITS)
    return n_think, torch.where(valid, first - 1, torch.full_like(first, -1))


def gold_reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """1 if the answer digit is (a + b) mod 5 after FLOOR to CAP THINK tokens, else 0 (the true task)."""
    n_think, digit = parse(answers)
    ids = prompt_ids(prompts)
    gold = (ids // N_DIGITS + ids % N_DIGITS) % N_DIGITS
    return ((digit == gold) & (n_think >= FLOOR) & (n_think <= CAP)).float()


class CorruptedReward:
    """The injected reward: the gold reward, but 0 whatever the answer on the prompt ids in `corrupted` [25] bool."""

    def __init__(self, corrupted: torch.Tensor) -> None:
        self.corrupted = corrupted

    def __call__(self, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        return gold_reward(prompts, answers) * (~self.corrupted[prompt_ids(prompts)]).float()


class LengthExplosionEnv(gym.Env):
    """Answer a two-digit prompt after thinking: THINK (action 0) adds a reasoning token, action d + 1 answers d.

    Observation: (a, b, THINK count). An answer ends the episode with the task reward (0 on a corrupted
    prompt id when `corrupted` is given); THINK at the cap ends it unanswered (reward 0, truncated).
    """

    metadata = {"render_modes": []}

    def __init__(self, corrupted: tuple[int, ...] = ()) -> None:
        mask = torch.zeros(N_PROMPTS, dtype=torch.bool)
        mask[list(corrupted)] = True
        self.reward_fn = CorruptedReward(mask)
        self.observation_space = gym.spaces.MultiDiscrete(np.array([N_DIGITS, N_DIGITS, CAP + 1], dtype=np.int64))
        self.action_space = gym.spaces.Discrete(N_DIGITS + 1)
        self._prompt, self._tokens = (0, 0), []

    def _obs(self) -> np.ndarray:
        return np.array([*self._prompt, len(self._tokens)], dtype=np.int64)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._prompt = tuple(int(x) for x in self.np_random.integers(0, N_DIGITS, 2))
        self._tokens = []
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not THINK (0) or an answer 1..{N_DIGITS}")
        if int(action) == THINK and len(self._tokens) >= CAP:
            return self._obs(), 0.0, False, True, {}
        self._tokens.append(int(action))
        if int(action) == THINK:
            return self._obs(), 0.0, False, False, {}
        prompt = torch.tensor([[BOS, self._prompt[0] + 1, self._prompt[1] + 1]])
        answer = torch.tensor([self._tokens + [EOS]])
        obs = np.array([*self._prompt, len(self._tokens) - 1], dtype=np.int64)
        return obs, float(self.reward_fn(prompt, answer)[0]), True, False, {}


if "stabench/LengthExplosion-v0" not in gym.registry:
    gym.register(id="stabench/LengthExplosion-v0", entry_point=LengthExplosionEnv)


STATE_FEATURES = torch.cat(
    [
        nn.functional.one_hot(torch.arange(N_PROMPTS) // N_DIGITS, N_DIGITS).repeat_interleave(CAP + 1, 0),
        nn.functional.one_hot(torch.arange(N_PROMPTS) % N_DIGITS, N_DIGITS).repeat_interleave(CAP + 1, 0),
        nn.functional.one_hot(torch.arange(CAP + 1), CAP + 1).repeat(N_PROMPTS, 1),
    ],
    1,
).float()  # [25 * (CAP + 1), 2 * 5 + CAP + 1]: one-hot a, one-hot b, one-hot THINK count


# --- The policy: an MLP over the sufficient statistics, behind a causal-LM interface. ---------------------
def allowed_table() -> torch.Tensor:
    """The rules as a mask [CAP + 2, N_ACTIONS + 1] over states: THINK count 0..CAP, then "answered"."""
    allowed = torch.zeros(CAP + 2, N_ACTIONS + 1, dtype=torch.bool)
    count = torch.arange(CAP + 1)
    allowed[: CAP + 1, THINK] = count < CAP
    allowed[: CAP + 1, 1 : N_DIGITS + 1] = (count >= FLOOR)[:, None]
    allowed[CAP + 1, EOS] = True
    return allowed


ALLOWED = allowed_table()


class ThinkerPolicy(nn.Module):
    """A causal LM over [BOS, a, b, answer tokens] whose logits at each position come from an MLP over the
    sufficient statistics of the prefix: one-hot a, one-hot b and one-hot *visible* THINK count.

    Why not the tiny GPT-2: `GRPO.iterate` samples token by token without a KV cache; with 14 answer tokens
    that costs ~28 ms per batch of 64 on one CPU thread (measured), ~40 ms per iteration with the update,
    i.e. ~14 s for a quick trial against a 3 s budget. THINK carries no content, so (prompt, THINK count)
    is the whole state: the MLP loses nothing a transformer could use here. It is evaluated once per call
    on all 25 x (CAP + 1) states and read as a table (memoized between optimizer steps while no gradient
    is being recorded, i.e. during sampling).

    The environment's rules are constrained decoding on top of the network (forced tokens get log-prob 0
    and no gradient): THINK below FLOOR, a digit at CAP, EOS after the answer. `bound_context(chunk,
    carry)` makes the network see a Markovian context (Delethink, Aghajohari et al. 2025): the first chunk
    holds `chunk` THINK tokens; after it the context is reset to the prompt plus the last `carry` tokens,
    so the visible count is carry + (count - chunk) mod (chunk - carry). The rules still read the true count.
    """

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2 * N_DIGITS + CAP + 1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
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
        """Logits [25, CAP + 2, N_ACTIONS + 1] of every (prompt, state), the rules applied."""
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
        run = (input_ids[:, 3:] == THINK).long().cumprod(1)  # 1 while the answer so far is all THINK
        state = torch.cat([torch.zeros_like(input_ids[:, :3]), run.cumsum(1)], 1)  # THINK count so far
        state[:, 3:].masked_fill_(run == 0, CAP + 1)  # answered
        return SimpleNamespace(logits=self.state_logits()[prompt_ids(input_ids)[:, None], state])


_WARM_STATE: dict[str, torch.Tensor] = {}


def warm_policy() -> ThinkerPolicy:
    """The RL start: the policy after a short supervised warm start on right answers after 2-4 THINK tokens.

    Deterministic (its own seeds and one thread whatever the caller uses); cached by `warm_start`.
    """
    if not _WARM_STATE:
        _WARM_STATE.update(warm_start("length-explosion", _warm_up, __file__))
    with torch.random.fork_rng():
        model = ThinkerPolicy()
    model.load_state_dict(_WARM_STATE)
    return model


def demonstration_targets() -> tuple[torch.Tensor, torch.Tensor]:
    """The warm start's data in closed form: (visit weight [CAP + 1], target [25, CAP + 1, 6] over THINK, digits).

    Demonstrations think k ~ uniform(WARM_THINK) tokens, then write the gold digit. At a count c inside
    WARM_THINK they are there with probability P(k >= c) and stop with probability 1 / (hi - c + 1).
    """
    lo, hi = WARM_THINK
    count = torch.arange(CAP + 1, dtype=torch.float32)
    free = (count >= lo) & (count <= hi)
    visit = torch.where(free, (hi - count + 1) / (hi - lo + 1), torch.zeros(()))
    stop = torch.where(free, 1 / (hi - count + 1).clamp_min(1), torch.zeros(()))
    target = torch.zeros(N_PROMPTS, CAP + 1, N_DIGITS + 1)
    target[..., THINK] = 1 - stop
    target[torch.arange(N_PROMPTS), :, GOLD + 1] = stop
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


# --- Exact quantities: the THINK count is the whole state, so one forward per prompt gives everything. ----


@torch.no_grad()
def exact_behaviour(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected THINK count [25], probability of the gold answer [25]) of every prompt under the policy."""
    thinks = torch.full((N_PROMPTS, CAP + 1), THINK, dtype=torch.long)
    probs = torch.softmax(answer_logits(model, ALL_PROMPTS, thinks, N_ACTIONS).double(), -1)  # [25, CAP + 1, A]
    reach = torch.cat([torch.ones(N_PROMPTS, 1, dtype=probs.dtype), probs[:, :-1, THINK].cumprod(1)], 1)
    stop = reach * (1 - probs[..., THINK])  # P(answer after exactly c THINK tokens)
    mean_think = (stop * torch.arange(CAP + 1, dtype=probs.dtype)).sum(1)
    right = (reach * probs.gather(-1, (GOLD + 1).view(-1, 1, 1).expand(-1, CAP + 1, 1)).squeeze(-1)).sum(1)
    return mean_think, right


# --- Knobs. ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """Keyword arguments of `LengthExplosion`."""

    onset: int | None = None  # overrides the quick and full tiers' onset iteration
    corrupted_share: float = CORRUPTED_SHARE  # share of prompt ids paid 0 from onset (injected branch)

    def check(self, horizon: int) -> None:
        if self.onset is not None:
            onset = self.onset
            if isinstance(onset, bool) or not isinstance(onset, int) or not 0 < onset < horizon:
                raise StabenchError(f"length-explosion: onset must be an integer in 1..{horizon - 1}, got {onset!r}")
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
        n_bad = max(1, round(corrupted_share * N_PROMPTS))
        self.corrupted = torch.zeros(N_PROMPTS, dtype=torch.bool)
        self.corrupted[self.rng.choice(N_PROMPTS, n_bad, replace=False)] = True
        self.injected_reward = CorruptedReward(self.corrupted)
        config = replace(GRPO_CONFIG, seed=seed)
        self.trainer = GRPO(warm_policy(), warm_policy(), gold_reward, config, stabilizer)

    def step(self, injected: bool) -> dict[str, float]:
        switched = injected and self.trainer.iteration >= self.budget.onset
        ids = on_default_device(self.rng.integers(0, N_PROMPTS, GRPO_CONFIG.n_groups))
        state = self.trainer.iterate(self.injected_reward if switched else gold_reward, ALL_PROMPTS[ids])
        mean_think, right = exact_behaviour(self.trainer.policy)
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": float(right.mean()),
            "entropy": state.extras["entropy"],
            "gt_think_mean": float(mean_think.mean()),
            "think_corrupted": float(mean_think[self.corrupted].mean()),
            "think_clean": float(mean_think[~self.corrupted].mean()) if (~self.corrupted).any() else math.nan,
            "gold_accuracy": float(right.mean()),
            "reward": float(state.batch["rewards"].mean()),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class LengthExplosion(Task):
    """See the module docstring."""

    id = "length-explosion"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=120, onset=30, seeds=5),
        "full": Budget(iterations=300, onset=30, seeds=10),
    }
    # Failure: on average over all prompts the chains spend more than half the THINK budget (CAP / 2 = 6;
    # the warm start thinks 2-4) over the last quarter of the run.
    ground_truth = GroundTruth(metric="gt_think_mean", threshold=CAP / 2, fails_when="above", reduce="tail_mean")
    matched_fix = "constant-norm"
    methods = ("baseline", "constant-norm", "markovian-chunks", "token-entropy-bonus")
    detector = DetectorSpec(metric="length_mean", threshold=CAP / 2 + 2)  # tokens incl. digit and EOS
    diagnostics = ("lengths",)
    return_floor = 1 / N_DIGITS  # a uniform guess
    return_ceiling = 1.0
    # Quick-tier crossings come 28-63 iterations into the 90 after onset: a window of 0.8 covers them all.
    detection_window = 0.8
    knobs_type = Knobs

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> LengthExplosionRun:
        return LengthExplosionRun(self.budget(tier), seed, stabilizer, self.diagnostics, self.knobs.corrupted_share)
