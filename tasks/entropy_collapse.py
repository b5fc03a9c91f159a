"""entropy-collapse: a majority vote on part of the batch (test-time-RL style) collapses GRPO's diversity while a
new rule is being learned, so the policy ends with few correct answers per prompt.

The world. A prompt is two digits (a, b) from 0-5 (36 prompts: 28 for training, 8 held out, none of them
holding a 5); an answer is 3 tokens from the same 6 digits (216 answers, all enumerable). The policy is a tiny
GPT-2 (1 layer, 32 wide, built from a config) warmed up by a short supervised phase on uniformly drawn answers
that use neither a nor b (the old rule), on the training prompts (fixed per task version, cached by
`tasks.tokens.warm_start`). The frozen reference is that warm start. GRPO: k3 KL to the reference at beta 0.1,
PPO clipping 0.2/0.2, 8 prompts x groups of 8, Adam lr 2e-3, 2 epochs per batch (so the ratio can leave 1).

What must be learned after onset (both branches). Before onset the old rule pays (1 for an answer avoiding a
and b). From onset the rule changes: a correct answer must also avoid the digit 5 (`correct_new`): 27
correct answers per held-out prompt (64 when a = b), many right answers. The warm start writes a 5 often:
held-out accuracy under the new rule 0.33, 13 live correct answers (probability >= 1%) per held-out prompt.
The control is paid `correct_new` on every group and learns it (held-out accuracy 0.87 in the tail).

The injection. From onset the injected branch keeps the gold verifier on 3 of its 8 groups and pays the
other 5 by a majority vote as in test-time RL (`gold_and_vote`): 1 if the answer equals its group's most
frequent answer (every tied mode counts; a group of 8 distinct answers earns nothing); correctness is not
consulted. The vote is maximized only by one answer per prompt: it sharpens.

Return (the true one, never the vote): on the held-out prompts, exactly by enumeration, the expected number of
distinct new-rule-correct answers in a group of 8 samples divided by 8, sum_{a correct} (1 - (1 - pi(a))^8) / 8
(pass@k-style coverage). It grows when the policy learns the rule and falls when it collapses.
- `return_floor` = 0.2904: the post-onset return of the policy frozen at onset (the `frozen-at-onset`
  reference), exact per seed by enumeration (constant after onset: 0.19-0.36), averaged over seeds 0-9. The
  warm start itself (`no-update`) earns 0.3102, normalized 0.09.
- `return_ceiling` = 0.5132: what the control (baseline method, control branch) reaches, its mean
  post-onset return averaged over seeds 0-9 (0.48-0.56 per seed). The exact post-onset optimum,
  `coverage_optimum()` = 0.8964 (uniform over the correct answers), is not used: the post-onset mean includes
  the learning phase, and GRPO's own rich-get-richer sharpening leaves the control 13 live correct answers of
  27, so no learner of this trainer comes near it (the control would score 0.37 against it).

Ground truth: `gt_expected_distinct` (8 x return: the expected number of distinct correct answers in a group
of 8), its mean over the last 25% of the run below 3.2. A learner that does not learn fails: the warm start has
2.48, the policies frozen at onset 1.53-2.87 (seeds 0-9); a collapsed policy has 1-2; the control 3.98-4.95.
The threshold was set on seeds 0-9 between the frozen policies' best and the matched fix's worst.

Mechanism, as the calibration measured it (quick tier, seeds 0-9, onset 3, 47 post-onset iterations): entropy
collapse driven by the vote, which also stalls the learning. In the tail the baseline's token entropy is 0.38
(control 0.99), its live correct answers 2.7-9.8 per held-out prompt (control 9.5-15.6), and its held-out
accuracy 0.82 (control 0.87): a group whose answers all agree has zero advantage, so the gold groups cannot
correct a collapsed prompt. Clip-higher (0.2/0.28) does not help (10/10 fail, nearly the baseline's numbers:
normalized return 0.03 vs 0.02): the vote's mode is the answer with positive advantage, and loosening the upper clip
only lets it grow as fast. What holds diversity is a pull back towards the diverse warm start: the k3 anchor
at 0.3 on top of the trainer's beta (`grpo-kl-anchor`) keeps 12-18 live answers and entropy 1.31, and still
learns part of the rule (accuracy 0.60), 0/10 fail. A plain per-token entropy bonus (0.3,
`grpo-entropy-bonus`) does the same at this budget (0/10 fail, normalized return 0.69; accuracy 0.51, the
entropy spent partly on wrong answers): it is a second working guard here, not a non-fix. Both guards also
keep the control more diverse than the baseline's control (return 0.56 vs 0.51).

Settings and where they were chosen: the new rule, beta 0.1 (with beta 0 the control's own sharpening left it
below the warm start's coverage), 3 gold groups of 8 (4 kept the injected collapse partial, 2 starved the fix
of learning), onset 3 (the old rule's healthy phase drifts the policy: a later onset widens the frozen
policies' spread) and the ground truth's 3.2 were chosen on seeds 0-3 and the full calibration run on seeds
0-9; floor and ceiling were measured on seeds 0-9; nothing on seeds 100-109 except the detector threshold.

Numbers (quick tier, 10 seeds each; normalized return with the 95% bootstrap interval):
  seeds 0-9 (calibration)       failure  control failure  normalized return [95% CI]
    baseline                      10/10     0/10             0.02 [-0.12, 0.15]   (control 1.00)
    grpo-kl-anchor (fix)           0/10     0/10             0.71 [0.66, 0.76]
    clip-higher                   10/10     0/10             0.03 [-0.12, 0.17]
    grpo-entropy-bonus             0/10     0/10             0.69 [0.62, 0.76]
    frozen-at-onset               10/10    10/10             0.00 [-0.15, 0.14]
    no-update                     10/10    10/10             0.09
  seeds 100-109 (fresh, nothing tuned on them)
    baseline                      10/10     0/10            -0.14 [-0.25, -0.01]  (control 0.98)
    grpo-kl-anchor (fix)           2/10     0/10             0.70 [0.63, 0.77]    (tail 2.96-4.15)
    frozen-at-onset               10/10    10/10             0.04 [-0.06, 0.15]
    no-update                     10/10    10/10             0.09
  A quick-tier trial (healthy phase and both branches) takes 8-9 s on one shared core (median).

Diagnostic: the token-entropy trend, `entropy_trend` = batch entropy minus its value 10 iterations before.
It falls below -0.7 nats in every baseline injected run, 7-26 iterations after onset (seeds 100-109), and
in 1 of 10 controls (its slow sharpening while it learns reaches -0.72); before onset it stays above -0.1.
The threshold -0.7 was chosen on seeds 100-109 only (the best threshold-detector score among -0.4 ... -0.8
there; -0.75 has no false alarm but misses a run). The frozen and no-update references fail without any
entropy fall: this diagnostic sees the collapse, not a learner that stopped.

The full tier (100 iterations, onset 5) was not re-measured for this version.

Suite 0.3.0 (one batch schema, stabilizers by function) re-measured on seeds 0-9 in the method matrix
(`results/matrix`): the matched fix, `grpo-kl-anchor` until 0.2.0 and now `kl-anchor` (the same 0.3 * k3 term
beside the trainer's beta), gives the same rows bit for bit: 0/10 fail, normalized 0.71 [0.66, 0.76]; the
baseline fails 10/10 (control 0/10, 1.00); both references fail 10/10 (at most 0.09). The plain entropy guard
changed: `grpo-entropy-bonus` (0.3 times a sampled-token surrogate) is gone, and the one `entropy-bonus` (0.05
times the exact per-token entropy, every trainer) fails 9/10 here (0.25 [0.15, 0.35]): at that coefficient an
entropy bonus does not stand in for the anchor. In the matrix `dr-grpo` (8/10 fail, 0.35) and `mini-critics`
(7/10, 0.31) also raise the return without preventing the collapse.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import gymnasium as gym
import numpy as np
import torch
from stabench.baselines.grpo import GRPO, GRPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.tokens import all_answers_logp, answer_logits, enumerate_answers, tiny_policy, warm_start
from torch import nn

# --- The world. ---------------------------------------------------------------------------------------------
N_ACTIONS = 6  # digits 0-5; id 6 is BOS
ANSWER_LEN = 3
BOS = N_ACTIONS
PROMPT_LEN = 3  # BOS, a, b
GROUP_SIZE = 8
ALL_ANSWERS = enumerate_answers(N_ACTIONS, ANSWER_LEN)  # [216, 3]
ALL_PROMPTS = torch.tensor([[BOS, a, b] for a in range(N_ACTIONS) for b in range(N_ACTIONS)])
HELDOUT_PAIRS = ((0, 1), (1, 3), (2, 2), (2, 4), (3, 0), (4, 4), (4, 1), (0, 2))  # fixed per task version
_HELD = {a * N_ACTIONS + b for a, b in HELDOUT_PAIRS}
HELDOUT_PROMPTS = ALL_PROMPTS[sorted(_HELD)]
TRAIN_PROMPTS = ALL_PROMPTS[[i for i in range(len(ALL_PROMPTS)) if i not in _HELD]]
NEW_BANNED = 5  # from onset a correct answer also avoids this digit
LIVE_PROB = 0.01  # an answer is "live" when the policy writes it at least once in 100 samples
DISTINCT_FLOOR = 3.2  # ground truth: tail mean of the expected distinct correct answers in a group of 8

# --- The policy and the trainer. ---------------------------------------------------------------------------
MODEL = {"n_embd": 32, "n_layer": 1, "n_head": 2}
WARMUP_SEED, WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 0, 100, 256, 1e-2
GRPO_CONFIG = GRPOConfig(
    n_groups=8, group_size=GROUP_SIZE, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=2e-3, beta=0.1,
    epochs=2, minibatches=1,
)  # fmt: skip
TREND_WINDOW = 10  # entropy_trend = entropy now minus entropy TREND_WINDOW iterations ago (or at the start)


# --- Rewards: the environment and the trainer both call these. --------------------------------------------
def correct(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """1 if no answer token equals either prompt digit (prompts [B, 3] = BOS, a, b; answers [B, 3])."""
    hits = (answers[:, :, None] == prompts[:, None, 1:]).any(-1).any(-1)
    return (~hits).float()


def correct_new(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The post-onset rule: `correct` and no token equal to NEW_BANNED."""
    return correct(prompts, answers) * (answers != NEW_BANNED).all(-1).float()


def majority_vote(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Test-time-RL reward: 1 if the answer is a most frequent answer of its group of GROUP_SIZE (group members
    adjacent), provided that answer occurs at least twice; correctness is not consulted."""
    codes = (answers * torch.tensor([N_ACTIONS**2, N_ACTIONS, 1])).sum(1).view(-1, GROUP_SIZE)
    counts = (codes[:, :, None] == codes[:, None, :]).sum(-1)
    top = counts.max(1, keepdim=True).values
    return ((counts == top) & (top > 1)).float().reshape(-1)


N_GOLD_GROUPS = 3  # injected branch: the first N_GOLD_GROUPS groups of a batch keep the gold verifier


def gold_and_vote(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The injected reward: `correct_new` on the first N_GOLD_GROUPS groups, `majority_vote` on the others."""
    split = N_GOLD_GROUPS * GROUP_SIZE
    vote = majority_vote(prompts, answers)
    gold = correct_new(prompts, answers)
    return torch.cat([gold[:split], vote[split:]])


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
    [correct_new(p[None].expand(len(ALL_ANSWERS), -1), ALL_ANSWERS) for p in HELDOUT_PROMPTS]
).double()  # [8, 216]
HELDOUT_OLD = torch.stack(
    [correct(p[None].expand(len(ALL_ANSWERS), -1), ALL_ANSWERS) for p in HELDOUT_PROMPTS]
).double()


def heldout_logp(model: nn.Module) -> torch.Tensor:
    """log pi(answer | prompt) for every held-out prompt and every answer: [8, 216] (enumerate_answers order)."""
    n_p, n_x = len(HELDOUT_PROMPTS), len(_PREFIXES)
    prompts = HELDOUT_PROMPTS.repeat_interleave(n_x, 0)
    answers = torch.cat([_PREFIXES, torch.zeros(n_x, 1, dtype=torch.long)], 1).repeat(n_p, 1)
    with torch.no_grad():
        logits = answer_logits(model, prompts, answers, N_ACTIONS)
    prefix_lp = torch.log_softmax(logits.double(), -1).view(n_p, n_x, ANSWER_LEN, N_ACTIONS)
    return torch.stack([all_answers_logp(lp) for lp in prefix_lp])


def heldout_accuracy(model: nn.Module) -> float:
    """The expected new-rule reward on the held-out prompts, exact: sum over answers of pi(answer) correct_new."""
    return float((heldout_logp(model).exp() * HELDOUT_CORRECT).sum(-1).mean())


def coverage(logp: torch.Tensor) -> torch.Tensor:
    """Per prompt, the expected share of a group of GROUP_SIZE samples that are distinct correct answers."""
    hit = 1 - (1 - logp.exp()).pow(GROUP_SIZE)
    return (HELDOUT_CORRECT * hit).sum(-1) / GROUP_SIZE


def heldout_stats(model: nn.Module) -> dict[str, float]:
    logp = heldout_logp(model)
    pi = logp.exp()
    cov = coverage(logp)
    return {
        "return": float(cov.mean()),
        "gt_expected_distinct": float(cov.mean() * GROUP_SIZE),
        "old_rule_accuracy": float((pi * HELDOUT_OLD).sum(-1).mean()),
        "live_correct": float(((pi >= LIVE_PROB) & (HELDOUT_CORRECT > 0)).sum(-1).double().mean()),
        "heldout_accuracy": float((pi * HELDOUT_CORRECT).sum(-1).mean()),
        "heldout_seq_entropy": float(-(pi * logp).sum(-1).mean()),
    }


def coverage_optimum() -> float:
    """The post-onset optimum of the return, exact: the uniform policy over each held-out prompt's correct answers
    (coverage is a sum of concave functions of the probabilities, symmetric in the correct answers)."""
    n_good = HELDOUT_CORRECT.sum(-1)
    uniform = torch.where(HELDOUT_CORRECT > 0, 1 / n_good[:, None], torch.zeros_like(HELDOUT_CORRECT))
    return float(coverage(uniform.log()).mean())


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
        which = self.prompt_rng.integers(len(TRAIN_PROMPTS), size=self.trainer.config.n_groups)
        onset = self.trainer.iteration >= self.budget.onset
        reward = (gold_and_vote if injected else correct_new) if onset else correct
        state = self.trainer.iterate(reward, TRAIN_PROMPTS[which])
        entropy = state.extras["entropy"]
        self.entropies.append(entropy)
        past = self.entropies[max(0, len(self.entropies) - 1 - TREND_WINDOW)]  # the first rows: since the start
        batch = state.batch
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "entropy": entropy,
            "entropy_trend": entropy - past,
            "reward": float(batch["rewards"].mean()),
            "train_accuracy": float(correct_new(batch["prompts"], batch["answers"]).mean()),
            **heldout_stats(self.trainer.policy),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


class EntropyCollapse(Task):
    """See the module docstring."""

    id = "entropy-collapse"
    family = "reasoning"
    version = "2"
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=50, onset=3, seeds=5),
        "full": Budget(iterations=100, onset=5, seeds=10),
    }
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
    knobs_type = Knobs

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> EntropyCollapseRun:
        return EntropyCollapseRun(self.budget(tier), seed, stabilizer, self.diagnostics)
