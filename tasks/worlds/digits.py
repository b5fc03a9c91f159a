"""The digit world that the digit tasks share (entropy-collapse, degenerate-comparisons, hard-sample-shortcuts,
inference-mismatch, calibration-collapse, plasticity-loss, reward-model-drift, moe-routing).

A prompt is two digits (a, b) from 0-5 (36 prompts: 28 for training, 8 held out, none of them holding a 5); an
answer is 3 tokens from the same 6 digits (216 answers, all enumerable). The old rule (`correct`) pays an answer
that uses neither a nor b; the new rule (`correct_new`), which every digit task asks both branches to learn after
onset, also bans the digit 5. The policy is a tiny GPT-2 (1 layer, 32 wide, built from a config) warmed up by a
short supervised phase on uniformly drawn old-rule answers of the training prompts (`warm_policy`, fixed per
version, shipped as a hash-checked file); it is also the frozen reference. Held-out statistics are exact, by
enumeration.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from stabench.baselines.grpo import GRPOConfig
from stabench.suite.api import Budget
from stabench.tasks.worlds.tokens import WarmStart, all_answers_logp, answer_logits, enumerate_answers, tiny_policy
from torch import nn

# --- Prompts and answers. ----------------------------------------------------------------------------------
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

# --- The policy, the trainer and the schedule the digit tasks share. ---------------------------------------
MODEL = {"n_embd": 32, "n_layer": 1, "n_head": 2}
WARMUP_SEED, WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 0, 100, 256, 1e-2
GRPO_CONFIG = GRPOConfig(
    n_groups=8, group_size=GROUP_SIZE, answer_len=ANSWER_LEN, n_actions=N_ACTIONS, lr=2e-3, beta=0.1,
    epochs=2, minibatches=1,
)  # fmt: skip
BUDGETS = {
    "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
    "quick": Budget(iterations=50, onset=3, seeds=5),
    "full": Budget(iterations=100, onset=5, seeds=10),
}


# --- The rules: the environments and the trainer both call these. ------------------------------------------
def correct(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """1 if no answer token equals either prompt digit (prompts [B, 3] = BOS, a, b; answers [B, 3])."""
    hits = (answers[:, :, None] == prompts[:, None, 1:]).any(-1).any(-1)
    return (~hits).float()


def correct_new(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The post-onset rule: `correct` and no token equal to NEW_BANNED."""
    return correct(prompts, answers) * (answers != NEW_BANNED).all(-1).float()


# --- The warm start (also the frozen reference). ----------------------------------------------------------
def answer_loss(model: nn.Module, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the answers' tokens given their prompts (the supervised warm-up's loss)."""
    logits = answer_logits(model, prompts, answers, N_ACTIONS)
    return nn.functional.cross_entropy(logits.reshape(-1, N_ACTIONS), answers.reshape(-1))


def fit_old_rule(
    model: nn.Module,
    steps: int,
    batch: int = WARMUP_BATCH,
    lr: float = WARMUP_LR,
    extend: Callable[[torch.Tensor, np.random.Generator], torch.Tensor] | None = None,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = answer_loss,
) -> nn.Module:
    """The digit tasks' supervised warm-up: Adam on uniformly drawn old-rule answers of uniformly drawn training
    prompts (its own Generator, seed WARMUP_SEED). `extend` appends task tokens to each batch of answers (a
    stated confidence, say) from the same Generator; `loss` replaces the cross-entropy (a router's balance term)."""
    rng = np.random.default_rng(WARMUP_SEED)
    good = [ALL_ANSWERS[correct(p[None].expand(len(ALL_ANSWERS), -1), ALL_ANSWERS).bool()] for p in TRAIN_PROMPTS]
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        which = rng.integers(len(TRAIN_PROMPTS), size=batch)
        answers = torch.stack([good[i][rng.integers(len(good[i]))] for i in which])
        if extend is not None:
            answers = extend(answers, rng)
        value = loss(model, TRAIN_PROMPTS[which], answers)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    return model


def seeded(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` under torch seed WARMUP_SEED, leaving the caller's random state as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(WARMUP_SEED)
        return build()


def _build() -> nn.Module:
    return tiny_policy(N_ACTIONS, PROMPT_LEN + ANSWER_LEN, **MODEL)


def _warm_up() -> nn.Module:
    return fit_old_rule(seeded(_build), WARMUP_STEPS)


# The tiny transformer after a supervised warm-up on uniformly drawn old-rule answers of the training prompts.
# Deterministic (its own seeds and one thread whatever the caller uses); shipped as
# tasks/warm_starts/digits.safetensors (after changing the warm-up: stabench warm-start --retrain), named by the
# world, which every digit task shares.
warm_policy = WarmStart("digits", _warm_up, _build,
                        sha256="248d67f2c7d5334403f321f33cb97191fb4b6adbade9e55eff4d51b4d40f14e6")


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
    """Exact held-out statistics: coverage as `return` (and x GROUP_SIZE as `gt_expected_distinct`), accuracy
    under both rules, live correct answers per prompt, and the answer distribution's entropy."""
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
    """The post-onset optimum of the coverage, exact: the uniform policy over each held-out prompt's correct
    answers (coverage is a sum of concave functions of the probabilities, symmetric in the correct answers)."""
    n_good = HELDOUT_CORRECT.sum(-1)
    uniform = torch.where(HELDOUT_CORRECT > 0, 1 / n_good[:, None], torch.zeros_like(HELDOUT_CORRECT))
    return float(coverage(uniform.log()).mean())


# --- A first digit, then every allowed continuation: the tree two 6-digit tasks evaluate exactly. ------------
def continuation_tree(prompts: torch.Tensor, allowed: list[list[int]], first: int,
                      answer_len: int) -> tuple[torch.Tensor, list[tuple[int, int]], list[torch.Tensor]]:  # fmt: skip
    """Rows [BOS, a, b, first, c_1 .. c_{answer_len - 2}] for every prompt and every continuation in its allowed
    digits ** (answer_len - 2): one forward gives the first digit's distribution and the distribution of every
    later digit along every allowed path. Returns the rows, each prompt's (start, end) span and its allowed digits."""
    rows, spans, oks = [], [], []
    start = 0
    for p, digits in zip(prompts, allowed, strict=True):
        ok = torch.tensor(digits)
        tails = ok[enumerate_answers(len(ok), answer_len - 2)]
        rows.append(torch.cat([torch.tensor([BOS, int(p[1]), int(p[2]), first]).expand(len(tails), -1), tails], 1))
        spans.append((start, start + len(tails)))
        oks.append(ok)
        start += len(tails)
    return torch.cat(rows), spans, oks


def completion(logp: torch.Tensor, ok: torch.Tensor) -> float:
    """P(every later digit in `ok` | the first digit), exact. `logp` [k ** m, m + 1, N_ACTIONS], one prompt's span of
    `continuation_tree`: row i is the i-th prefix in ok ** m (`enumerate_answers` order), entry [i, t] the
    distribution of the digit after the first t of that prefix."""
    sub = logp[..., ok]  # [k ** m, m + 1, k]
    prefixes = enumerate_answers(len(ok), logp.shape[1] - 1)
    head = sub[:, :-1].gather(-1, prefixes[..., None]).squeeze(-1).sum(-1)
    return float(torch.logsumexp(head + torch.logsumexp(sub[:, -1], -1), 0).exp())
