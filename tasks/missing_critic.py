"""missing-critic: critic-free REINFORCE credits a whole answer's advantage to every token; once rewards turn
sparse and one batch mixes short- and long-horizon problems, the long problems' rare signal drowns and they stall.

The world. A tiny GPT-2 policy (1 layer, 32 wide, built from a config) writes 10 tokens from a vocabulary of 4:
the sub-steps of a walk mod 4, c_t = 1 + (t + 1) mod 4, after a prompt [BOS, kind]. Each batch holds 3 groups of
SHORT problems and 3 of LONG ones, 8 answers each. Trainer: GRPO configured as critic-free REINFORCE with a
batch-mean baseline (`baseline="batch"`, no std division, beta 0), Adam lr 3e-3, one pass in 2 minibatches
(so the `grad_variance` diagnostic has two gradients to compare).

The injection. Healthy phase (11 iterations) and the control throughout: a dense reward, the share of the 10
sub-steps that are right, for both kinds. From onset the injected branch pays sparsely, at the end: a SHORT
problem pays 1 iff its first 2 sub-steps are right (its other 8 tokens are unscored), a LONG one pays 1 iff
all 10 are right.

Ground truth: the exact probability that the policy writes the whole LONG chain right (the correct answer is
unique: one teacher-forced forward), mean over the last 25% of the run below 0.5. That is the task's return
too. A run fails when it solves the long problem less often than not at the end.

What must be learned after onset: at onset (iteration 11 of 45 at quick) the LONG chain is still to be learned
in BOTH branches (the control's dense reward and the injected branch's sparse reward have the same optimum,
1), so a learner that stops learning fails on every seed.

Normalized return: `return_floor` is what the policy FROZEN AT ONSET earns (each seed's exact LONG success at
onset), `return_ceiling` what the baseline's control reaches (its post-onset mean LONG success; the exact
optimum 1 would understate the control); both averaged over calibration seeds 0-9, measured once and fixed.
Seeds each setting was chosen on: the world, trainer and the 0.5 threshold on seeds 0-4 (version 1); the
mini-critics' GAE lambda 0.8 on seeds 0-9 (version 3); version 4's chain of 10, onset 11, 45-iteration quick
tier, floor and ceiling on seeds 0-9; the detector threshold on seeds 100-109 only (version 2, re-checked on
version 4's seeds 100-109 runs). The measured numbers are in results/calibration.md.

Version 4 (why the horizon and onset moved; numbers in results/calibration.md). In version 3 (chain of 8, onset
7, 60 iterations) the fix failed on some fresh seeds. Those seeds did not start from a rarer long signal (their
long success at onset was among the highest) nor from another batch (the mix is fixed); what differed was a race
after onset: within a few iterations one sub-step of the long chain, which moves with the short problems' same
position in this policy, collapsed to a wrong token before the first few long successes arrived, and once one
sub-step is wrong with certainty the long reward is 0 and nothing recovers it. Resetting the critics at onset
(a throw-away check) did not remove such failures, so they are not the critics' stale dense-phase values. The fix
wins the race when the long chain is solved a few times in a hundred at onset; the baseline loses it while it is
solved about once in a hundred. Per-token credit also learns faster in the healthy phase, and the gap compounds
over the chain (success is a product of per-step accuracies), so a longer chain with a later onset separates the
two branches' starting points. The 45 iterations keep the trial's cost (10 tokens instead of 8).

Mechanism. With b the batch-mean reward, every token of a SHORT success gets A = 1 - b, its 8 unscored tokens
included: these pushes are large, frequent and random with respect to the long chain, which shares those
positions, while the LONG problem's signal comes from a handful of rare successes. The baseline solves SHORT and
stalls on LONG. The same run with LONG problems only (same onset and reward; measured in version 1, chain of 8)
does not stall, so the sparse reward alone is not the failure; the mix is. Nor is it only the batch-mean offset
between the kinds: a group-mean baseline (still one advantage per answer) fails as well (checked with a
throw-away advantages hook, not shipped). Not entropy: the injected baseline keeps more entropy than the control,
and an entropy bonus (`entropy-bonus-low`, the named non-fix) does not rescue it. `mini-critics` (2 MLP critics
on disjoint halves of each group, per-position centred GAE) give the unscored tokens advantages near 0 and the
long chain per-token credit. Its limit, measured and not tuned away: if onset comes while the long chain is still
solved only about once in a hundred (version 3), on some seeds the policy commits to a wrong long answer
(per-step accuracy stuck, entropy falling) before enough long successes arrive.

Diagnostic: the trace of the gradient covariance across the 2 minibatches (`grad_var`), and the scale-free
noise-to-signal ratio `grad_var_rel` (part of the jump in `grad_var` is the larger advantages of a 0/1 reward,
which `grad_var_rel` factors out). The default detector alarms at `grad_var` above 0.1, chosen ONLY on the
baseline's runs on seeds 100-109, where it separates the injected runs (crossing within a few iterations of
onset) from the healthy phase and the control.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
from stabench.baselines.grpo import GRPO, GRPOConfig
from stabench.suite.api import POLICY_REUSE, Budget, DetectorSpec, Figure, GroundTruth, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import DiagnosedRun
from stabench.suite.figures import lines, need
from stabench.tasks.worlds.scaffold import OnsetKnobs
from stabench.tasks.worlds.tokens import AnswerEnv, answer_logits, tiny_policy
from torch import nn

# --- The world: a walk mod K of CHAIN_LEN sub-steps, c_t = START + (t + 1) STRIDE mod K, after a prompt
# [BOS, kind]; kind SHORT asks for the first SHORT_LEN sub-steps only, kind LONG for the whole chain. --------
N_ACTIONS = 4  # K: tokens 0..3 are answer tokens (and the prompt's kind); id 4 is BOS
BOS_ID = N_ACTIONS
CHAIN_LEN = 10  # sub-steps per answer (8 until version 4)
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
class MissingCriticRun(DiagnosedRun):
    """One seed under one method: the GRPO trainer holds the policy, optimizer, sampler and stabilizer state."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        self.budget, self.diagnostics = budget, diagnostics
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            policy = tiny_policy(N_ACTIONS, PROMPTS.shape[1] + CHAIN_LEN, **MODEL)
        reference = tiny_policy(N_ACTIONS, PROMPTS.shape[1] + CHAIN_LEN, **MODEL)  # unused: beta = 0
        self.trainer = GRPO(policy, reference, dense_reward, replace(GRPO_CONFIG, seed=seed), stabilizer)

    def train(self, injected: bool) -> tuple[dict[str, float], TrainState]:
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
        return row, state


def fig_pg_variance(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    rows = need(table, "missing-critic", "grad_var")
    return lines(rows, "grad_var", "policy-gradient variance across minibatches", out, name, log=True)


class MissingCritic(Task):
    """See the module docstring."""

    id = "missing-critic"
    family = "reasoning"
    version = "4"  # chain of 10 (8), onset 11 (7), 45 quick iterations (60); v3: 60 iterations, lambda 0.8
    trainer = "grpo"
    provides = frozenset({POLICY_REUSE})  # 2 minibatch steps per batch: the second one's ratio leaves 1
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=45, onset=11, seeds=5),
        "full": Budget(iterations=100, onset=11, seeds=10),
    }
    ground_truth = GroundTruth(metric="gt_success", threshold=0.5, fails_when="below", reduce="tail_mean", tail=0.25)
    matched_fix = "mini-critics"
    methods = ("baseline", "mini-critics", "entropy-bonus-low")
    detector = DetectorSpec(metric="grad_var", threshold=0.1)
    diagnostics = ("grad_variance",)
    # Floor: the policy frozen at onset, its exact LONG success averaged over calibration seeds 0-9; ceiling:
    # the control's post-onset mean LONG success on the same seeds. Both measured once and fixed (docstring).
    return_floor = 0.0102
    return_ceiling = 0.551
    experimental = False  # version 4 meets the bar on seeds 0-9 and every failure-rate check on 100-109
    knobs_type = OnsetKnobs  # the iteration the sparse reward switches on
    environments = {"stabench/WalkChain-v0": "WalkChainEnv"}
    figures = (
        Figure("pg-variance", "policy-gradient variance",
               "Policy-gradient variance across minibatches on missing-critic, baseline and mini-critics.",
               fig_pg_variance),
    )
    paper = """On missing-critic the policy writes a walk of 10 sub-steps for two kinds of problems in one batch, and
from onset the injected branch pays sparsely, at the end: a short problem for its first 2 sub-steps, a long one
only for all 10. Critic-free REINFORCE gives every token of an answer the same advantage, so the frequent short
successes push the 8 tokens they leave unscored, which the long chain shares, at random, while the long
problem's signal comes from a handful of rare successes: the baseline solves the short problems and stalls on
the long one, and its gradient variance across minibatches jumps at onset. Neither the sparse reward alone
(long problems only do not stall) nor entropy explains it. Mini-critics, small critics that give the unscored
tokens advantages near 0 and the long chain per-token credit, learn it ({failed:mini-critics} runs fail, the
baseline {failed:baseline}). The fix's margin is a race: if the sparse reward switches on while the long chain is
still rarely solved (an earlier version, with a chain of 8 and an earlier onset), a shared sub-step can collapse to
a wrong token before the first long successes arrive, and the fix failed on some fresh seeds (results/calibration.md;
figure below)."""

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> MissingCriticRun:
        return MissingCriticRun(self.budget(tier), seed, stabilizer, self.diagnostics)
