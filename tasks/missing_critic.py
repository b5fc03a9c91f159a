"""missing-critic (EXPERIMENTAL in version 3, see below): critic-free REINFORCE credits a whole answer's
advantage to every token; once rewards turn sparse and one batch mixes short- and long-horizon problems, the long
problems' rare signal drowns and they stall.

The world. A tiny GPT-2 policy (1 layer, 32 wide, built from a config) writes 8 tokens from a vocabulary of 4:
the sub-steps of a walk mod 4, c_t = 1 + (t + 1) mod 4, after a prompt [BOS, kind]. Each batch holds 3 groups of
SHORT problems and 3 of LONG ones, 8 answers each. Trainer: GRPO configured as critic-free REINFORCE with a
batch-mean baseline (`baseline="batch"`, no std division, beta 0), Adam lr 3e-3, one pass in 2 minibatches
(so the `grad_variance` diagnostic has two gradients to compare).

The injection. Healthy phase (7 iterations) and the control throughout: a dense reward, the share of the 8
sub-steps that are right, for both kinds. From onset the injected branch pays sparsely, at the end: a SHORT
problem pays 1 iff its first 2 sub-steps are right (its other 6 tokens are unscored), a LONG one pays 1 iff
all 8 are right. At onset the exact LONG success is 0.003-0.005 and the SHORT success 0.21.

Ground truth: the exact probability that the policy writes the whole LONG chain right (the correct answer is
unique: one teacher-forced forward), mean over the last 25% of the run below 0.5. That is the task's return
too. A run fails when it solves the long problem less often than not at the end; the control reaches
0.91-0.94 over the tail (seeds 0-9, version 3).

What must be learned after onset (issue 12, "not learning must not win"): at onset (iteration 7) the LONG
success is 0.001-0.005, so in BOTH branches the long chain is still to be learned (the control's dense reward
takes it to 0.91-0.94; the injected branch's sparse reward has the same optimum, 1). A learner that stops
learning fails on every seed: `frozen-at-onset` keeps 0.001-0.005, `no-update` 0.000.

Normalized return (version 3): `return_floor` = 0.0031 is what the policy FROZEN AT ONSET earns, the exact
(teacher-forced) LONG success of each seed's onset policy averaged over the calibration seeds 0-9 (0.0014
0.0040 0.0025 0.0052 0.0034 0.0029 0.0034 0.0035 0.0014 0.0037), measured once and fixed; version 3 does not
change the healthy phase, so version 2's floor holds (re-measured: the same ten numbers).
`return_ceiling` = 0.666 is what the control reaches: the baseline's control's post-onset mean LONG success
averaged over seeds 0-9 (0.648-0.685 per seed; it climbs from ~0 to 0.92 over the 53 post-onset iterations of
the 60-iteration quick tier), measured once and fixed; with the exact optimum 1 as ceiling the control would
normalize to 0.67. Version 2 (40 iterations) used 0.515, version 1 anchored on 0 and 1.

Version 3 changes (both chosen on seeds 0-9 only, injected branch of mini-critics, one run per setting):
the quick tier runs 60 iterations instead of 40 (onset 7 unchanged), and the mini-critics' GAE lambda is 0.8
instead of 0.5. Failed seeds out of 0-9 (tail below 0.5) for what was tried: version 2 (lambda 0.5, 40
iterations) 2/10; with an entropy term inside the fix, coef 0.01: 4/10, coef 0.03: 10/10 (the policy stays
near uniform); lambda 0.3: 3/10; lambda 0.8: 2/10 but no early commitment (the two failures, 0.13 and 0.36,
were still climbing, per-step accuracy 0.89 and 0.96); critic lr 3e-2: 5/10; 4 critics: 4/10; 8 critic steps:
2/10; 60 iterations at lambda 0.5: 2/10 (seed 4 stuck at per-step accuracy 0.50); onset 12 with 45
iterations: not finished (stopped for time); lambda 0.8 with 60 iterations: 0/10 (tails 0.86-0.97), kept.
Seeds each setting was chosen on: the world, trainer, onset and the 0.5 threshold are version 1's, chosen on
seeds 0-4; version 2 chose the floor on seeds 0-9; version 3 chose the 60 iterations, lambda 0.8 and the
ceiling on seeds 0-9 and checked the detector threshold on seeds 100-109.

Calibration, version 3 (quick tier: 60 iterations, onset 7; tail = iterations 45-59; failed = tail below 0.5),
seeds 0-9:
| method | failed (injected) | control failed | normalized return [95% CI] | injected tail, seeds 0-9 |
|---|---|---|---|---|
| baseline | 10/10 | 0/10 | 0.002 [-0.004, 0.010] | 0.00 on every seed (0.01 on seed 4, 0.07 on seed 7) |
| mini-critics | 0/10 | 0/10 | 0.878 [0.762, 0.977] | 0.97 0.97 0.87 0.95 0.95 0.95 0.97 0.96 0.96 0.94 |
| grpo-entropy-bonus-low | 10/10 | 0/10 | -0.003 [-0.004, -0.002] | 0.00-0.01 |
| frozen-at-onset | 10/10 | 10/10 | 0.000 [-0.001, 0.001] | 0.001-0.005 |
| no-update | 10/10 | 10/10 | -0.005 [-0.005, -0.005] | 0.000 |
Bar on seeds 0-9: met (baseline control normalized 1.00, mini-critics' control 1.10, tails 0.93-0.95).
Fresh seeds 100-109 (nobody tuned on them):
| method | failed (injected) | control failed | normalized return [95% CI] |
|---|---|---|---|
| baseline | 9/10 | 0/10 | 0.084 [-0.004, 0.259] |
| mini-critics | 3/10 | 0/10 | 0.680 [0.382, 0.931] |
| frozen-at-onset | 10/10 | 10/10 | 0.000 [-0.001, 0.001] |
| no-update | 10/10 | 10/10 | -0.005 [-0.005, -0.005] |
Mini-critics' tails on seeds 100-109: 0.95 0.00 0.95 0.97 0.00 0.00 0.96 0.96 0.96 0.96 (final per-step
accuracy on the failed seeds 101, 104, 105: 0.46 0.67 0.51); the baseline's one success is seed 103 (0.93),
its control tails 0.92-0.94.

Why EXPERIMENTAL (version 3): on seeds 0-9 the task meets the bar (fix 0/10, its interval [0.76, 0.98] clear
of the baseline's and both references'), but on the fresh seeds 100-109 the matched fix still fails 3/10
(version 2: 4/10), over the bar's 20%; the baseline (9/10), control (0/10) and references (10/10) checks
hold there. The fix's failures are the one mechanism below (early commitment to a wrong long answer, per-step
accuracy stuck at 0.46-0.67). Nothing was tuned on seeds 100-109. Not tried: a later onset (its run was
stopped for time), a still longer run, the AsyPPO masking of tokens where the critics agree.

Mechanism, as the calibration measured it (quick tier, seeds 0-4, version 1, 40 iterations and lambda 0.5;
version 2's seeds 0-9 agree; version 3's numbers are in the tables above).
With b the batch-mean reward, every token
of a SHORT success gets A = 1 - b, its 6 unscored tokens included: these pushes are large, frequent (SHORT
success climbs to 0.90) and random with respect to the long chain, which shares those positions, while the
LONG problem's signal comes from a handful of rare successes. The baseline solves SHORT (0.90) and stalls on
LONG: tail success 0.00 in 5/5 (per-step accuracy on the long chain 0.44), control 0.83-0.86. The same run with
LONG problems only (6 groups, same onset and reward) does NOT stall: tail success 0.77-0.94 in 5/5, so the
sparse reward alone is not the failure; the mix is. Nor is it only the batch-mean offset between the kinds: a
group-mean baseline (A = R - mean of the answer's group, still one advantage per answer) also fails 5/5
(checked with a throw-away advantages hook, not shipped). Not entropy: the injected baseline keeps MORE entropy than
the control (0.45 against 0.13 over the tail), and an entropy bonus (the built-in guard at coef 0.01,
`grpo-entropy-bonus-low`; at its own 0.3 it holds the policy uniform and fails the control too) still fails
5/5 with entropy 0.4-0.9. Mini-critics (2 MLP critics on disjoint halves of each group, GAE lambda 0.5,
per-position centred) give the unscored tokens advantages near 0 and the long chain per-token credit: tail
LONG success 0.90 0.91 0.78 0.91 0.00 (fails 1/5), control 0.88-0.90. Over seeds 0-9 (version 2) it fails 2/10
(seeds 4 and 8): there the long chain's per-step accuracy stops at 0.4-0.6 while the entropy falls to
0.17-0.38, so the policy commits to a wrong long answer before enough long successes arrive (on the other
seeds per-step accuracy reaches 0.98-0.99). That is the fix's limit, measured, not tuned away. Version 3
(lambda 0.8, 60 iterations) removes it on seeds 0-9 but not on seeds 100-109 (3 seeds, per-step accuracy
0.46-0.67 at the end).

Diagnostic, measured: the trace of the gradient covariance across the 2 minibatches (`grad_var`), median after
onset 0.133 for the injected baseline against 0.0045 for its control (pre-onset 0.016) and 0.015 with
mini-critics; the scale-free noise-to-signal ratio `grad_var_rel` 2.4 against 1.2. Part of the jump in `grad_var`
is the larger advantages of a 0/1 reward, which `grad_var_rel` factors out. The default detector alarms at
`grad_var` above 0.1, chosen (version 2) ONLY on seeds 100-109, where any threshold between 0.080 and 0.20
separates and version 1's 0.1 was kept: the baseline's pre-onset rows peak at 0.074 and its control rows at
0.080, while every injected baseline run crosses 0.1 within 4 iterations of onset (its maximum over the first 8
post-onset iterations is 0.20-1.04). Version 3 re-checked it on its own seeds 100-109 runs (60 iterations),
with the same numbers: pre-onset peak 0.074, control peak 0.080 over all 53 post-onset iterations, every
injected baseline run above 0.1 within 0-4 iterations of onset (maximum over the first 8 post-onset
iterations 0.20-1.04); post-onset medians 0.106 injected baseline, 0.0018 its control, 0.011 mini-critics.

Suite 0.3.0 (one batch schema, stabilizers by function) re-measured seeds 0-9 and 100-109: every return of the
baseline, `mini-critics` and both references equals 0.2.0's bit for bit, so the verdict stands (fix 3/10 on
fresh seeds). The named non-fix `grpo-entropy-bonus-low` (0.01 times a sampled-token surrogate) became
`entropy-bonus-low` (0.01 times the exact per-token entropy, the one entropy bonus of every trainer): 8/10
fail, normalized 0.10 [0.00, 0.25] on seeds 0-9 (was 10/10, -0.003).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from stabench.baselines.grpo import GRPO, GRPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.tokens import AnswerEnv, answer_logits, tiny_policy
from torch import nn

# --- The world: a walk mod K of CHAIN_LEN sub-steps, c_t = START + (t + 1) STRIDE mod K, after a prompt
# [BOS, kind]; kind SHORT asks for the first SHORT_LEN sub-steps only, kind LONG for the whole chain. --------
N_ACTIONS = 4  # K: tokens 0..3 are answer tokens (and the prompt's kind); id 4 is BOS
BOS_ID = N_ACTIONS
CHAIN_LEN = 8  # sub-steps per answer
SHORT_LEN = 2  # sub-steps a SHORT problem is scored on after onset
START, STRIDE = 1, 1
SHORT, LONG = 0, 1
N_SHORT, N_LONG = 3, 3  # groups of each kind per batch
PROMPTS = torch.tensor([[BOS_ID, SHORT]] * N_SHORT + [[BOS_ID, LONG]] * N_LONG)

# --- The policy and the trainer: critic-free REINFORCE with a batch-mean baseline, two minibatches. ---------
MODEL = {"n_embd": 32, "n_layer": 1, "n_head": 2}
GRPO_CONFIG = GRPOConfig(n_groups=len(PROMPTS), group_size=8, answer_len=CHAIN_LEN, n_actions=N_ACTIONS, lr=3e-3,
                         beta=0.0, baseline="batch", std_normalize=False, minibatches=2)


def correct_chain(n: int, length: int = CHAIN_LEN) -> torch.Tensor:
    """The one correct answer, [n, length]: c_t = START + (t + 1) STRIDE mod K (the same for both kinds)."""
    return ((START + torch.arange(1, length + 1) * STRIDE) % N_ACTIONS).expand(n, length)


def dense_reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Healthy phase (and the control throughout): the share of the sub-steps that are right, either kind."""
    return (answers == correct_chain(len(answers), answers.shape[1])).float().mean(1)


def sparse_reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """From onset (the injection): 1 only if every sub-step the problem asks for is right, paid at the end.

    A SHORT problem asks for the first SHORT_LEN sub-steps, a LONG one for all CHAIN_LEN.
    """
    right = answers == correct_chain(len(answers), answers.shape[1])
    return torch.where(prompts[:, 1] == LONG, right.all(1), right[:, :SHORT_LEN].all(1)).float()


class WalkChainEnv(AnswerEnv):
    """The task as a gymnasium environment for one problem kind; `injected` picks the post-onset (sparse) reward."""

    def __init__(self, injected: bool = False, kind: int = LONG) -> None:
        reward = sparse_reward if injected else dense_reward
        super().__init__(reward, N_ACTIONS, CHAIN_LEN, prompt=torch.tensor([[BOS_ID, kind]]))



def exact_success(model: nn.Module) -> tuple[float, float, float]:
    """Exactly, by teacher forcing the unique correct answer (one forward for both kinds):
    (P(all CHAIN_LEN sub-steps right | LONG), mean per-step P(right | right prefix) on LONG,
    P(the first SHORT_LEN sub-steps right | SHORT))."""
    chain = correct_chain(2)
    prompts = torch.tensor([[BOS_ID, LONG], [BOS_ID, SHORT]])
    with torch.no_grad():
        lp = torch.log_softmax(answer_logits(model, prompts, chain, N_ACTIONS).double(), -1)
    step_lp = lp.gather(-1, chain[..., None]).squeeze(-1)
    return float(step_lp[0].sum().exp()), float(step_lp[0].exp().mean()), float(step_lp[1, :SHORT_LEN].sum().exp())


# --- One run. ----------------------------------------------------------------------------------------------
class MissingCriticRun:
    """One seed under one method: the GRPO trainer holds the policy, optimizer, sampler and stabilizer state."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        self.budget, self.diagnostics = budget, diagnostics
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            policy = tiny_policy(N_ACTIONS, PROMPTS.shape[1] + CHAIN_LEN, **MODEL)
        reference = tiny_policy(N_ACTIONS, PROMPTS.shape[1] + CHAIN_LEN, **MODEL)  # unused: beta = 0
        self.trainer = GRPO(policy, reference, dense_reward, replace(GRPO_CONFIG, seed=seed), stabilizer)

    def step(self, injected: bool) -> dict[str, float]:
        switched = injected and self.trainer.iteration >= self.budget.onset
        state = self.trainer.iterate(sparse_reward if switched else dense_reward, PROMPTS)
        success, step_acc, short_success = exact_success(self.trainer.policy)
        row: dict[str, float] = {
            "step": float(self.trainer.tokens),
            "return": success,
            "entropy": state.extras["entropy"],
            "gt_success": success,
            "step_accuracy": step_acc,
            "short_success": short_success,
            "reward": float(state.batch["rewards"].mean()),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return row


@dataclass(frozen=True)
class Knobs:
    """Keyword arguments of `MissingCritic`."""

    onset: int | None = None  # iteration the sparse reward switches on (None: the tier's)

    def check(self, iterations: int) -> None:
        if self.onset is not None:
            if isinstance(self.onset, bool) or not isinstance(self.onset, int):
                raise StabenchError(f"missing-critic: onset must be an integer, got {self.onset!r}")
            if not 0 < self.onset < iterations:
                raise StabenchError(f"missing-critic: onset {self.onset} must lie strictly inside the run of "
                                    f"{iterations} iterations")


class MissingCritic(Task):
    """See the module docstring."""

    id = "missing-critic"
    family = "reasoning"
    version = "3"  # 60 quick iterations (40 in version 2); mini-critics' lambda 0.8 (0.5)
    trainer = "grpo"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=60, onset=7, seeds=5),
        "full": Budget(iterations=100, onset=7, seeds=10),
    }
    ground_truth = GroundTruth(metric="gt_success", threshold=0.5, fails_when="below", reduce="tail_mean", tail=0.25)
    matched_fix = "mini-critics"
    methods = ("baseline", "mini-critics", "entropy-bonus-low")
    detector = DetectorSpec(metric="grad_var", threshold=0.1)
    diagnostics = ("grad_variance",)
    # Floor: the policy frozen at onset, its exact LONG success averaged over calibration seeds 0-9; ceiling:
    # the control's post-onset mean LONG success on the same seeds. Both measured once and fixed (docstring).
    return_floor = 0.0031
    return_ceiling = 0.666
    experimental = True  # the matched fix fails 3/10 on fresh seeds 100-109 (see the docstring)
    knobs_type = Knobs

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> MissingCriticRun:
        return MissingCriticRun(self.budget(tier), seed, stabilizer, self.diagnostics)
