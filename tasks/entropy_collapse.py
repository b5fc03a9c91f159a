"""entropy-collapse: a majority-vote (test-time-RL style) reward sharpens GRPO onto one answer per prompt.

The world. A prompt is two digits (a, b) from 0-5 (36 prompts: 28 for training, 8 held out); an answer is 3
tokens from the same 6 digits (216 answers, all enumerable). An answer is correct when it uses neither a nor
b: 64 correct answers per prompt (125 when a = b), so the problem has many right answers. The policy is a
tiny GPT-2 (1 layer, 32 wide, built from a config) warmed up by a short supervised phase on uniformly drawn
correct answers of the training prompts (fixed per task version, cached by `tasks.tokens.warm_start`): it starts diverse
(46 correct answers above 1% per held-out prompt, token entropy 1.46 nats, held-out accuracy 0.97). The
frozen reference is that warm start. GRPO as DAPO/TTRL-style recipes run it: no KL term (beta 0), PPO
clipping 0.2/0.2, 8 prompts x groups of 8, Adam lr 2e-3, 2 epochs per batch (so the ratio can leave 1).

The injection. Healthy phase and control: reward 1 for any correct answer (an all-correct group has zero
advantage, so the policy keeps many answers). From onset the injected branch is paid a majority vote as in
test-time RL: 1 if the answer equals its group's most frequent answer (every tied mode counts; a group of 8
distinct answers earns nothing); correctness is not consulted. Only a one-answer-per-prompt policy
maximizes it: it sharpens.

Return (the true one, never the vote): on the held-out prompts, exactly, the expected number of distinct
correct answers in a group of 8 samples divided by 8, sum_{a correct} (1 - (1 - pi(a))^8) / 8: what a
many-answer problem pays a sampler (pass@k-style coverage). It falls when the policy collapses and when it
writes wrong answers. Normalized 0 is 1/8 (always one correct answer), 1 the uniform policy over the correct
answers (0.953, `coverage_bounds()`).

Ground truth: `gt_distinct_correct`, the mean over held-out prompts of the number of correct answers with
probability at least 1%, below 4 at any post-onset iteration: with fewer than 4 live answers a group of 8
samples is mostly repeats, i.e. the policy has collapsed (the warm start has 46, a collapsed policy 1).

Mechanism, as the calibration measured it (quick tier, seeds 0-4, onset 15, 35 post-onset iterations):
this IS entropy collapse, driven by the reward. At onset the policy has 26-36 live answers per held-out
prompt and token entropy 1.2-1.3. Under the vote the baseline's token entropy falls to 0.01-0.05 and the
live answers to 0.6-2.4 (crossing 4 at 9-19 iterations after onset, 5/5 seeds); the answer it collapses onto
is often wrong on held-out prompts (accuracy 0.74-1.00). The control drifts slowly (GRPO's own
rich-get-richer sharpening over 2 epochs: 13-22 live answers, entropy 0.35-1.08 at the end) but never
crosses. Clip-higher (0.2/0.28) does not help: 5/5 fail, and so do eps_high 0.5 and no upper clip at all
(5/5 each): the upper clip binds on 0.2-0.6% of tokens on average, and loosening it only lets the
group's mode, the answer with positive advantage, grow faster. DAPO's mechanism (a symmetric clip starving
rare tokens) is not what collapses this policy; the reward is. What holds diversity is an anchor to the
diverse reference: k3 to the warm start at 0.3 (`grpo-kl-anchor`) keeps 12-19 live answers, entropy
0.8-1.2, accuracy 0.86-0.97, 0/5 fail. A plain entropy bonus (0.3) keeps entropy on 3 seeds but collapses
on 2 (2/5 fail) and spends the entropy on wrong answers (held-out accuracy 0.73-0.88).

Diagnostic: the token-entropy trend, `entropy_trend` = batch entropy minus its value 10 iterations before.
It falls below -0.6 nats 6-10 iterations after onset in every baseline run, before the ground truth
crosses, and never on a control (their lowest trend: -0.55).

Full tier, checked on seeds 0-3 (100 iterations, onset 25): baseline 4/4 fail (0.6-0.9 live answers), control
0/4 (its slow drift bottoms at 9-17 live answers, batch entropy down to 0.08 on one seed; its trend reaches
-0.55, close to the detector's -0.6), grpo-kl-anchor 0/4 (12-14 live answers at worst).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from baselines.grpo import GRPO, GRPOConfig
from suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from suite.diagnostics import DIAGNOSTICS
from tasks.tokens import all_answers_logp, answer_logits, enumerate_answers, tiny_policy, warm_start

# --- The world. ---------------------------------------------------------------------------------------------
N_ACTIONS = 6  # digits 0-5; id 6 is BOS
ANSWER_LEN = 3
BOS = N_ACTIONS
PROMPT_LEN = 3  # BOS, a, b
GROUP_SIZE = 8
ALL_ANSWERS = enumerate_answers(N_ACTIONS, ANSWER_LEN)  # [216, 3]
ALL_PROMPTS = torch.tensor([[BOS, a, b] for a in range(N_ACTIONS) for b in range(N_ACTIONS)])
HELDOUT_PAIRS = ((0, 1), (1, 3), (2, 2), (2, 5), (3, 0), (4, 4), (5, 1), (5, 3))  # fixed per task version
_HELD = {a * N_ACTIONS + b for a, b in HELDOUT_PAIRS}
HELDOUT_PROMPTS = ALL_PROMPTS[sorted(_HELD)]
TRAIN_PROMPTS = ALL_PROMPTS[[i for i in range(len(ALL_PROMPTS)) if i not in _HELD]]
LIVE_PROB = 0.01  # an answer is "live" when the policy writes it at least once in 100 samples
DISTINCT_FLOOR = 4.0

# --- The policy and the trainer. ---------------------------------------------------------------------------
MODEL = {"n_embd": 32, "n_layer": 1, "n_head": 2}
WARMUP_SEED, WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 0, 100, 256, 1e-2
GRPO_CONFIG = GRPOConfig(
    n_groups=8, group_size=GROUP_SIZE, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=2e-3, beta=0.0,
    epochs=2, minibatches=1,
)  # fmt: skip
TREND_WINDOW = 10  # entropy_trend = entropy now minus entropy TREND_WINDOW iterations ago (or at the start)


# --- Rewards: the environment and the trainer both call these. --------------------------------------------
def correct(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """1 if no answer token equals either prompt digit (prompts [B, 3] = BOS, a, b; answers [B, 3])."""
    hits = (answers[:, :, None] == prompts[:, None, 1:]).any(-1).any(-1)
    return (~hits).float()


def majority_vote(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Test-time-RL reward: 1 if the answer is a most frequent answer of its group of GROUP_SIZE (group members
    adjacent), provided that answer occurs at least twice; correctness is not consulted."""
    codes = (answers * torch.tensor([N_ACTIONS**2, N_ACTIONS, 1])).sum(1).view(-1, GROUP_SIZE)
    counts = (codes[:, :, None] == codes[:, None, :]).sum(-1)
    top = counts.max(1, keepdim=True).values
    return ((counts == top) & (top > 1)).float().reshape(-1)


class EntropyCollapseEnv(gym.Env):
    """One episode: a training prompt (a, b), then a group of GROUP_SIZE answers of ANSWER_LEN tokens.

    Observation: [a, b, the group's tokens so far padded with BOS]. Action: the next digit. Reward (the
    trainer's functions): with `injected=False`, `correct` paid at the end of each answer; with
    `injected=True`, the group's summed `majority_vote` paid at the last token (the vote needs the group).
    """

    metadata = {"render_modes": []}

    def __init__(self, injected: bool = False) -> None:
        self.injected = injected
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
            if not self.injected:
                reward = float(correct(prompts[-1:], answers[-1:])[0])
            elif done:
                reward = float(majority_vote(prompts, answers).sum())
        return self._obs(), reward, done, False, {}


if "stabench/EntropyCollapse-v0" not in gym.registry:
    gym.register(id="stabench/EntropyCollapse-v0", entry_point=EntropyCollapseEnv)


# --- The warm start (also the frozen reference). ----------------------------------------------------------
_WARM_STATE: dict[str, torch.Tensor] = {}


def warm_policy() -> nn.Module:
    """The tiny transformer after a supervised warm-up on uniformly drawn correct answers of the training prompts.

    Deterministic (its own seeds and one thread whatever the caller uses); cached by `warm_start`.
    """
    if not _WARM_STATE:
        _WARM_STATE.update(warm_start("entropy-collapse", _warm_up, __file__))
    with torch.random.fork_rng():
        model = tiny_policy(N_ACTIONS, PROMPT_LEN + ANSWER_LEN, **MODEL)
    model.load_state_dict(_WARM_STATE)
    return model


def _warm_up() -> nn.Module:
    rng = np.random.default_rng(WARMUP_SEED)
    with torch.random.fork_rng():
        torch.manual_seed(WARMUP_SEED)
        model = tiny_policy(N_ACTIONS, PROMPT_LEN + ANSWER_LEN, **MODEL)
    good = [ALL_ANSWERS[correct(p[None].expand(len(ALL_ANSWERS), -1), ALL_ANSWERS).bool()] for p in TRAIN_PROMPTS]
    optimizer = torch.optim.Adam(model.parameters(), lr=WARMUP_LR)
    for _ in range(WARMUP_STEPS):
        which = rng.integers(len(TRAIN_PROMPTS), size=WARMUP_BATCH)
        answers = torch.stack([good[i][rng.integers(len(good[i]))] for i in which])
        logits = answer_logits(model, TRAIN_PROMPTS[which], answers, N_ACTIONS)
        loss = nn.functional.cross_entropy(logits.reshape(-1, N_ACTIONS), answers.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


# --- Exact evaluation on the held-out prompts (one batched forward). --------------------------------------
_PREFIXES = enumerate_answers(N_ACTIONS, ANSWER_LEN - 1)  # [36, 2]
HELDOUT_CORRECT = torch.stack(
    [correct(p[None].expand(len(ALL_ANSWERS), -1), ALL_ANSWERS) for p in HELDOUT_PROMPTS]
).double()  # [8, 216]


def heldout_logp(model: nn.Module) -> torch.Tensor:
    """log pi(answer | prompt) for every held-out prompt and every answer: [8, 216] (enumerate_answers order)."""
    n_p, n_x = len(HELDOUT_PROMPTS), len(_PREFIXES)
    prompts = HELDOUT_PROMPTS.repeat_interleave(n_x, 0)
    answers = torch.cat([_PREFIXES, torch.zeros(n_x, 1, dtype=torch.long)], 1).repeat(n_p, 1)
    with torch.no_grad():
        logits = answer_logits(model, prompts, answers, N_ACTIONS)
    prefix_lp = torch.log_softmax(logits.double(), -1).view(n_p, n_x, ANSWER_LEN, N_ACTIONS)
    return torch.stack([all_answers_logp(lp) for lp in prefix_lp])


def coverage(logp: torch.Tensor) -> torch.Tensor:
    """Per prompt, the expected share of a group of GROUP_SIZE samples that are distinct correct answers."""
    hit = 1 - (1 - logp.exp()).pow(GROUP_SIZE)
    return (HELDOUT_CORRECT * hit).sum(-1) / GROUP_SIZE


def heldout_stats(model: nn.Module) -> dict[str, float]:
    logp = heldout_logp(model)
    pi = logp.exp()
    return {
        "return": float(coverage(logp).mean()),
        "gt_distinct_correct": float(((pi >= LIVE_PROB) & (HELDOUT_CORRECT > 0)).sum(-1).double().mean()),
        "heldout_accuracy": float((pi * HELDOUT_CORRECT).sum(-1).mean()),
        "heldout_seq_entropy": float(-(pi * logp).sum(-1).mean()),
    }


def coverage_bounds() -> tuple[float, float]:
    """(floor, ceiling): one correct answer always (1 / GROUP_SIZE); the uniform policy over the correct answers."""
    n_good = HELDOUT_CORRECT.sum(-1)
    uniform = torch.where(HELDOUT_CORRECT > 0, 1 / n_good[:, None], torch.zeros_like(HELDOUT_CORRECT))
    return 1 / GROUP_SIZE, float(coverage(uniform.log()).mean())


# --- Knobs. ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """`EntropyCollapse(**knobs)`; the defaults are the calibrated task."""

    onset: int | None = None  # first injected iteration at the quick and full tiers (None: the tier's own)

    def check(self, shortest_run: int) -> None:
        ok = isinstance(self.onset, (int, np.integer)) and not isinstance(self.onset, bool)
        if self.onset is not None and not (ok and 0 < self.onset < shortest_run):
            raise StabenchError(
                f"entropy-collapse: onset must be an integer in 1..{shortest_run - 1} (inside every quick and full "
                f"run), got {self.onset!r}"
            )


# --- One run. ----------------------------------------------------------------------------------------------
class EntropyCollapseRun:
    """One seed: the GRPO trainer (policy, reference, Adam, sampler Generator), the prompt Generator and the
    entropy history all live here, so `copy.deepcopy` branches everything."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        self.budget, self.diagnostics = budget, diagnostics
        reference = warm_policy().eval().requires_grad_(False)
        policy = warm_policy().train()
        self.trainer = GRPO(policy, reference, correct, replace(GRPO_CONFIG, seed=seed), stabilizer)
        self.prompt_rng = np.random.default_rng([seed, 1])
        self.entropies: list[float] = []

    def step(self, injected: bool) -> dict[str, float]:
        switched = injected and self.trainer.iteration >= self.budget.onset
        which = self.prompt_rng.integers(len(TRAIN_PROMPTS), size=self.trainer.config.n_groups)
        state = self.trainer.iterate(majority_vote if switched else correct, TRAIN_PROMPTS[which])
        entropy = state.extras["entropy"]
        self.entropies.append(entropy)
        past = self.entropies[max(0, len(self.entropies) - 1 - TREND_WINDOW)]  # the first rows: since the start
        batch = state.batch
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "entropy": entropy,
            "entropy_trend": entropy - past,
            "reward": float(batch["rewards"].mean()),
            "train_accuracy": float(correct(batch["prompts"], batch["answers"]).mean()),
            **heldout_stats(self.trainer.policy),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class EntropyCollapse(Task):
    """See the module docstring."""

    id = "entropy-collapse"
    family = "reasoning"
    version = "1"
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=50, onset=15, seeds=5),
        "full": Budget(iterations=100, onset=25, seeds=10),
    }
    ground_truth = GroundTruth(metric="gt_distinct_correct", threshold=DISTINCT_FLOOR, fails_when="below")
    matched_fix = "grpo-kl-anchor"
    methods = ("baseline", "grpo-kl-anchor", "clip-higher", "grpo-entropy-bonus")
    # Collapse under way: token entropy down 0.6 nats (of ~1.3 at onset) within 10 iterations.
    detector = DetectorSpec(metric="entropy_trend", threshold=-0.6, above=False)
    diagnostics = ("grad_norms",)
    return_floor = 0.125  # coverage_bounds(); a test checks both
    return_ceiling = 0.9533522769603938
    # Quick-tier crossings come 9-19 iterations after onset (of 35): a window of 0.6 (21 iterations) covers them.
    detection_window = 0.6
    knobs_type = Knobs

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> EntropyCollapseRun:
        return EntropyCollapseRun(self.budget(tier), seed, stabilizer, self.diagnostics)
