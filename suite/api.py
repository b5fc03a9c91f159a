"""The public contract between tasks, trainers, stabilizers, diagnostics and detectors.

A *task* builds a `Run`: one seed of one training process that advances one iteration per `step`.
The runner trains the healthy phase once, deep-copies the run at the onset iteration, and continues
the copy twice: once with the injection switched on, once without (the control). Everything a run
needs (model, optimizer, environments, RNG state) must therefore live inside the run object so that
`copy.deepcopy` branches it completely.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:  # torch is imported by the code that builds models, not by the CLI's argument checks
    import pandas as pd
    import torch
    from torch import nn

TIERS: tuple[str, ...] = ("smoke", "quick", "full")
# The tiers whose task settings passed the calibration bar (`results/calibration.md`: every task at the quick
# tier's budgets). `smoke` checks only that everything runs; `full` (longer runs, more seeds) was not
# recalibrated when the tasks were redesigned, so its scores are not the calibrated claims: `stabench run` warns
# and `stabench submit` refuses it.
CALIBRATED_TIERS: tuple[str, ...] = ("quick",)
# Learners that do not learn (`suite.references`): they anchor the floor of the stabilizer track.
REFERENCE_METHODS: tuple[str, ...] = ("no-update", "frozen-at-onset")
VARIANTS: tuple[str, ...] = ("injected", "control")
# A built-in (`suite.registry.discover`) is a class of a built-in module that sets a literal `name` (a task: `id`) in
# its own body. One that also sets `listed = False` there is left out of the registry, the matrix and `stabench list`
# (an ablation run by reference, a base that others fill in). Both are read from the source: never inherited.
LISTED = "listed"


class StabenchError(Exception):
    """A user-facing error: the CLI prints its message as one line and exits non-zero."""


class Diverged(Exception):
    """Raised by a trainer when its loss or parameters stop being finite.

    The runner records the run's rows up to that point with status `diverged`; the sweep goes on.
    """


@dataclass(frozen=True)
class Budget:
    """Length of one run at one tier. `onset` is the iteration at which the injection switches on."""

    iterations: int
    onset: int
    seeds: int
    report_every: int = 10

    def __post_init__(self) -> None:
        if not 0 < self.onset < self.iterations:
            raise StabenchError(
                f"onset {self.onset} must lie strictly inside the run of {self.iterations} iterations"
            )
        if self.seeds < 1:
            raise StabenchError(f"seeds must be at least 1, got {self.seeds}")


@dataclass(frozen=True)
class GroundTruth:
    """The privileged signal that says whether a run failed.

    `metric` is a column every row of the task carries. With `reduce="any"` the run fails if the metric
    crosses `threshold` at any post-onset iteration; with `reduce="tail_mean"` it fails if the mean over
    the last `tail` share of the run crosses it. `fails_when` says which side of the threshold is failure.
    """

    metric: str
    threshold: float
    fails_when: Literal["above", "below"]
    reduce: Literal["any", "tail_mean"] = "any"
    tail: float = 0.25


@dataclass(frozen=True)
class DetectorSpec:
    """A task's default pairing of a diagnostic with a threshold alarm (the first, simple detector)."""

    metric: str
    threshold: float
    above: bool = True


@dataclass(frozen=True)
class Figure:
    """A figure a task draws for the paper.

    `name` is a slug (lower-case words joined by hyphens, no number): the paper names the figure's files
    `<task id>_<name>` and numbers its figures in the order its text shows them, so no number is typed by hand.
    `draw(table, out, file)` reads the tidy rows of every task in the results (it selects its own; a missing task
    or column raises `stabench.suite.figures.Skip` with the reason), writes `out/figures/<file>.{pdf,png}` (the
    name the paper gives it, for `suite.figures.save`) and returns the paths. `caption` is printed under the
    figure.
    `grid_cells`: the figure also reads rows of a grid's cells (runs made with knobs), which others never see; it is
    handed its own task's rows only (a suite figure: every row).
    """

    name: str
    title: str
    caption: str
    draw: Callable[[pd.DataFrame, Path, str], list[Path]]
    grid_cells: bool = False


@dataclass
class TrainState:
    """What a diagnostic may read after one training iteration.

    `batch` holds the iteration's rollout tensors (keys documented by each trainer), `grads` the
    gradient of each parameter on the iteration's last minibatch (taken before the optimizer step),
    `losses` the scalar loss report (`LOSS_SCHEMA`: the keys `TRAINER_LOSSES` names for the trainer), and
    `extras` anything trainer-specific (reference log-probs, activations, the exact distribution of a tiny
    policy, ...) and, in every trainer, `loss_terms`: the terms the last update minimized, as floats.
    """

    model: nn.Module
    batch: Mapping[str, torch.Tensor]
    grads: Mapping[str, torch.Tensor]
    losses: Mapping[str, float]
    extras: dict[str, Any] = field(default_factory=dict)


class Run(Protocol):
    """One seed of one task under one method. `step` trains one iteration and returns one metrics row.

    Every row carries at least `step` (environment steps or tokens so far), `return` (the task's
    true return, never the injected proxy), `entropy` (mean policy entropy), the task's ground-truth
    metric, and the diagnostics the task computes: a run that subclasses `suite.diagnostics.DiagnosedRun` writes
    `train` (its row and the iteration's `TrainState`) and gets the task's declared `diagnostics` appended.
    """

    def step(self, injected: bool) -> dict[str, float]: ...


# The one batch schema of the policy-gradient trainers (`ppo`, `grpo`, `token-ppo`, `tool-ppo`). An "action"
# is a token (token trainers: per-action tensors are [B, L]) or an environment step (PPO: [B]); per-answer or
# per-episode tensors are [B]. Every trainer hands its hooks these keys where it has them (`TRAINER_KEYS`),
# with these meanings, so a stabilizer written against the schema runs on every trainer that has what it reads.
BATCH_SCHEMA: dict[str, str] = {
    "logp": "log pi_theta(a) of each taken action; carries the graph of the current update in `kl_loss` and "
            "`loss` (detached in `advantages`)",
    "old_logp": "log pi_old(a): the learner's own log-prob at the start of the update (detached)",
    "behaviour_logp": "log-prob under what really sampled the action: the inference sampler or the lagged "
                      "actor; equals old_logp where the learner sampled (detached)",
    "anchor_logp": "the denominator of the trainer's own ratio (detached): behaviour_logp where the trainer "
                   "forms its term against the stored sampling log-probs (PPO, tool-PPO), old_logp where it "
                   "recomputes them with the learner (GRPO, token-PPO: a sampler mismatch goes uncorrected)",
    "ref_logp": "log-prob under the frozen reference policy (trainers with a reference)",
    "advantages": "per-action advantage; in `loss`, exactly what the trainer's policy term uses (after the "
                  "`advantages` hook and any normalization)",
    "entropy": "per-action entropy H(pi_theta(. | s)) carrying the graph (in `loss`)",
    "mask": "1.0 on real actions, 0.0 on padding",
    "token_weight": "aggregation weights: every term of the trainer is sum(per_action * token_weight)",
    "clip_low": "0-d: the ratio's lower clip is 1 - clip_low",
    "clip_high": "0-d: the ratio's upper clip is 1 + clip_high",
    "rewards": "the reward the learner saw: per answer or episode [B] (token trainers), per step (PPO)",
    "group": "[B] index of the prompt group an answer belongs to (group-relative trainers)",
    "values": "V(s) of the critic at rollout (trainers with a critic)",
    "returns": "value targets the critic regresses on (trainers with a critic)",
    "new_values": "V(s) carrying the critic's graph (in `loss`, trainers with a critic)",
    "kl_coef": "0-d: beta, the coefficient of the trainer's own KL term (trainers with a reference)",
    "prompts": "[B, P] prompt tokens (token trainers with prompts)",
    "answers": "[B, L] answer tokens (token trainers with prompts)",
    "dones": "per step: 1.0 where the observation starts a new episode (PPO's GAE convention)",
    "turn": "[B, L] turn index of each action (multi-turn trainers)",
    "obs": "per step: the observation (PPO)",
    "actions": "the taken actions",
    "confidence": "[B] the confidence an answer states, in [0, 1] (tasks whose policy states one: "
                  "`Task.provides` 'confidence')",
}
# The policy term every trainer minimizes, per action: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) with
# r = exp(logp - anchor_logp), aggregated as sum(per_action * token_weight). A stabilizer that rewrites it
# reads the same keys and aggregates the same way.
_PG = frozenset({"logp", "old_logp", "behaviour_logp", "anchor_logp", "advantages", "entropy", "mask",
                 "token_weight", "clip_low", "clip_high", "rewards", "actions"})
# A capability, not a tensor: `behaviour_policy`, the runs' actions are sampled by something other than the learner at
# pi_old (an inference engine, a lagged actor), so `behaviour_logp` can differ from `old_logp`. Where it does not,
# the importance-sampling corrections compute the trainer's own term exactly and do not act. tool-PPO always samples
# through its engine (its own temperature, a step-by-step forward); a GRPO, token-PPO or PPO task declares it
# (`Task.provides`) when it has a sampler of its own.
BEHAVIOUR_POLICY = "behaviour_policy"
# A capability, not a tensor: `policy_reuse`, some update of an iteration sees a ratio r = pi_theta / anchor other than
# 1: the trainer takes several optimizer steps on each batch (epochs x minibatches > 1), or forms its ratio against a
# sampler other than the learner. Where neither holds (one on-policy step per batch: r = 1 exactly), an objective that
# only reshapes the ratio (CISPO, GSPO, SAPO, KL-Cov: `baselines/stabilizers/objectives.py`, `entropy.py`) has the
# trainer's own gradient and does not act. PPO, token-PPO and tool-PPO reuse every batch; a GRPO task declares it
# (`Task.provides`) when its config takes more than one step per batch.
POLICY_REUSE = "policy_reuse"
TRAINER_KEYS: dict[str, frozenset[str]] = {
    "ppo": _PG | {"values", "returns", "new_values", "dones", "obs"},
    "grpo": _PG | {"ref_logp", "kl_coef", "group", "prompts", "answers"},
    "token-ppo": _PG | {"values", "returns", "new_values", "prompts", "answers", "mc_returns", "critic_age",
                        "critic_resets"},
    "tool-ppo": _PG | {"group", "turn"},
    # DQN's own subset (per update, `loss` only, terms {"td": ...}): obs, actions, rewards, next_obs,
    # terminated, td_target, and ref_obs (an independent replay sample the TD loss never sees). No policy
    # log-probs, no `advantages` or `kl_loss` hook.
    "dqn": frozenset({"obs", "actions", "rewards", "next_obs", "terminated", "td_target", "ref_obs"}),
}
# Capabilities every task of a trainer has (beside its batch keys; a task adds its own with `Task.provides`).
TRAINER_CAPABILITIES: dict[str, frozenset[str]] = {
    "ppo": frozenset({POLICY_REUSE}),  # update_epochs x num_minibatches steps per rollout (every PPO task: > 1)
    "token-ppo": frozenset({POLICY_REUSE}),  # epochs x minibatches (default 2 x 2)
    "tool-ppo": frozenset({BEHAVIOUR_POLICY, POLICY_REUSE}),  # its engine samples; epochs per rollout (default 4)
}


# The one loss report of every trainer, `TrainState.losses`: these keys (a trainer reports those `TRAINER_LOSSES`
# names), with these meanings. Every value is the MEAN OVER THE ITERATION'S UPDATES (every minibatch step of every
# epoch) of its value on the update's minibatch, except `ratio_max` (the largest over the updates) and `entropy`
# (once, at rollout); NaN where no update ran. The values are the trainer's own terms, read before a stabilizer's
# `loss` hook rewrites them, except `loss`. What the last update minimized, term by term after the hook and with
# the coefficients, is `extras["loss_terms"]` ({"policy": ..., "value": ..., "kl": ..., "entropy": ..., "td": ...,
# and the stabilizer's own}).
LOSS_SCHEMA: dict[str, str] = {
    "loss": "the sum the update minimized: every term after the `loss` hook, coefficients and stabilizers' included",
    "policy_loss": "the trainer's policy term max(-A r, -A clip(r)) aggregated with `token_weight`, no coefficient",
    "value_loss": "(V - target)^2 / 2 aggregated like the policy term, without vf_coef (trainers with a critic)",
    "kl_loss": "the reference KL term after the `kl_loss` hook, aggregated, without beta (trainers with a reference)",
    "entropy_loss": "per-action entropy of the policy being updated, aggregated with `token_weight` (the entropy "
                    "term before its coefficient and sign)",
    "approx_kl": "k3 estimate of KL(anchor || pi_theta): mean over real actions of (r - 1) - log r, r = exp(logp - "
                 "anchor_logp)",
    "clip_frac": "share of real actions whose ratio r lies outside [1 - clip_low, 1 + clip_high]",
    "ratio_p99": "99th percentile (linear interpolation) of r over the update's real actions",
    "ratio_max": "the largest r of the iteration (the max over its updates, not a mean)",
    "entropy": "mean per-action entropy of the policy that collected the rollout (once per iteration)",
    "td_loss": "DQN: mean (Q(s, a) - y)^2 over the replay sample",
    "q_mean": "DQN: mean Q(s, a) over the replay sample",
}
_PG_LOSSES = frozenset({"loss", "policy_loss", "entropy_loss", "approx_kl", "clip_frac", "ratio_p99", "ratio_max",
                        "entropy"})
TRAINER_LOSSES: dict[str, frozenset[str]] = {
    "ppo": _PG_LOSSES | {"value_loss"},
    "grpo": _PG_LOSSES | {"kl_loss"},
    "token-ppo": _PG_LOSSES | {"value_loss"},
    "tool-ppo": _PG_LOSSES,
    # DQN's subset: no policy ratio; `entropy` is that of softmax(Q(s, .)) over the states it acted on.
    "dqn": frozenset({"loss", "td_loss", "q_mean", "entropy"}),
}
# The trainers that call the `rollout` hook (those with step rollouts); a stabilizer that overrides it applies only
# to their tasks (`Stabilizer.applies_to`).
ROLLOUT_TRAINERS: frozenset[str] = frozenset({"ppo"})


class Stabilizer:
    """A plugin that changes a trainer through named hook points. Every hook defaults to no change.

    Hook order, the same in every trainer: `model` and `optimizer` once, when a run is built; then each
    iteration `rollout` (trainers with step rollouts, `ROLLOUT_TRAINERS`) -> `advantages` (once, on the whole
    batch) -> per minibatch `kl_loss` (trainers with a reference KL term) -> `loss` -> backward ->
    `after_backward` -> optimizer step. A hook receives the trainer's default value and returns what to use
    instead; the batch it reads follows `BATCH_SCHEMA`. Diagnostics always see the raw gradients, taken before
    `after_backward`; a gradient set to `None` in `after_backward` means "no update for that parameter", in every
    trainer. What a trainer reports of its losses follows `LOSS_SCHEMA`.

    Where a stabilizer applies: `needs` names the batch keys (or task capabilities, `Task.provides`) it reads,
    and it runs on every task whose trainer and task provide them (`applies_to`). `trainers` narrows that by
    hand only where a need is not a key (a stabilizer that rebuilds the network needs the trainer's model
    kind). On a task where it does not apply, a method scores as the baseline (its runs are the baseline's).
    """

    name: ClassVar[str] = "baseline"
    needs: ClassVar[frozenset[str]] = frozenset()
    trainers: ClassVar[frozenset[str]] = frozenset()
    # The method's settings and where `stabench tune` may search them, declared once, in Ray Tune's vocabulary:
    # class attribute -> a Tune domain (`tune.loguniform(0.03, 3.0)`, `tune.uniform`, `tune.choice`, `tune.randint`,
    # ...). The class attribute's own value is the default setting, the one `stabench run` uses; `name@key=value`
    # runs another (`kl-anchor@coef=0.1`), `name@tuned` the one `stabench tune` chose. Empty: nothing to tune.
    search_space: ClassVar[Mapping[str, Any]] = {}

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        """Replace or wrap the network. `spec` describes what the task built (sizes, depth, ...)."""
        return model

    def optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return optimizer

    def rollout(self, batch: dict[str, torch.Tensor], info: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Rewrite the whole rollout once per iteration, before `advantages` (trainers in `ROLLOUT_TRAINERS`).

        `batch` is the iteration's flattened rollout with the trainer's advantages and value targets; return it
        with any key replaced (V-trace replaces `advantages` and `returns`), the same shapes. `info` describes the
        rollout (PPO: num_steps, num_envs, gamma, gae_lambda, next_value, next_done; rows are t-major,
        t * num_envs + e). Default: the batch unchanged."""
        return batch

    def advantages(self, advantages: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return advantages

    def kl_loss(self, per_token_kl: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Per-action KL regularizer that enters the loss (trainers with a reference); default: the trainer's."""
        return per_token_kl

    def loss(self, terms: dict[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Add or change loss terms; the trainer minimizes their sum."""
        return terms

    def after_backward(self, model: nn.Module) -> None:
        """Edit gradients in place (clipping, per-layer normalization); `None` skips a parameter's update."""

    def drops_all_gradients(self) -> bool:
        """True only while `after_backward` sets every gradient to `None` (the references): no update changes
        the model, so a trainer may skip the backward, `after_backward` and the optimizer step of every update
        whose gradients it does not report (`TrainState.grads`, `minibatch_grads`). Default False."""
        return False

    def applies_to(self, task: Task) -> bool:
        """True where the task's trainer and the task provide every key this stabilizer `needs` (and, for one that
        overrides `rollout`, where the trainer calls that hook)."""
        if self.trainers and task.trainer not in self.trainers:
            return False
        if type(self).rollout is not Stabilizer.rollout and task.trainer not in ROLLOUT_TRAINERS:
            return False  # its `rollout` would never be called there
        return self.needs <= provided_keys(task)


def provided_keys(task: Task) -> frozenset[str]:
    """The batch keys and capabilities a task's runs offer a stabilizer: its trainer's and its own."""
    trainer = TRAINER_KEYS.get(task.trainer, frozenset()) | TRAINER_CAPABILITIES.get(task.trainer, frozenset())
    return trainer | frozenset(getattr(task, "provides", ()))


class Detector:
    """A streaming rule over one run's diagnostics: `update` sees one row at a time, in order.

    The row a detector receives is what a practitioner watching the run would see (`suite.detectors.
    visible_row`): `iteration`, `step` and the task's visible diagnostics (`suite.visibility`: the columns the
    task's baseline fills, the same set whatever method runs, missing values as NaN). Never in it: the true
    return `return`, every `gt_*` column, the task's ground-truth metric, the columns the task lists in
    `Task.privileged`, the other detectors' alarms, the run's bookkeeping (task, method, seed, variant, phase,
    status, divergence marker), and configuration columns (settings such as the step size, or an injected
    environment's own parameters, `Task.configuration`), nor a column only some methods add. A detector cannot
    tell an injected branch from its control, or one method from another, except through the diagnostics.
    `for_task` may read the task's declared pairing (`Task.detector`) and the tier's budget (its onset); a
    built-in learns "healthy" only from the pre-onset rows (the first `budget.onset` rows it receives).

    A learned detector overrides `fit` (a classmethod) and `load`. The harness (`suite.crossfit`) calls
    `fit(rows, task, budget)` with the visible rows of training runs, plus `run` (an integer per run) and `label`
    (1: an injected run that failed; 0: a run that stayed healthy, control or injected), and hands what it returns
    to `load` of each fresh detector before its first `update`. It is cross-fitted: the runs a detector scores were
    never in its `fit` (K-fold over seeds crossed with leave-one-method-out: fitted on the other methods' runs on
    the seeds outside the scored fold), so recognizing a method earns nothing. The state must not hold a reference
    to `rows`; a learned detector is scored by `stabench score DIR --detector ...`, not recorded by `stabench run`.
    """

    name: ClassVar[str] = "detector"
    # True for a placeholder computed at scoring time from the run's metadata (the ground truth, the injection, the
    # method's record), never from rows: a run does not record its alarms. A literal (read from the source).
    from_metadata: ClassVar[bool] = False

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> Detector:
        """A fresh detector for one run of `task` at a tier; override to read the task's declared pairing."""
        return cls()

    @classmethod
    def fit(cls, rows: pd.DataFrame, task: Task, budget: Budget) -> Any:
        """A learned detector's fit step: a state learned from the training runs' `rows` (see above; possibly
        empty). Not overridden: the detector is not learned."""
        return None

    def load(self, state: Any) -> None:
        """Receive the state `fit` returned, before the first `update` (learned detectors)."""

    def update(self, row: Mapping[str, float]) -> bool:
        """Return True to raise an alarm at this row."""
        raise NotImplementedError


class ThresholdDetector(Detector):
    """Alarm whenever `metric` is on the wrong side of a fixed threshold (missing values never alarm).

    `for_task` reads the task's `detector` pairing (diagnostic and threshold).
    """

    name = "threshold"

    def __init__(self, metric: str, threshold: float, above: bool = True) -> None:
        self.metric, self.threshold, self.above = metric, threshold, above

    @classmethod
    def for_task(cls, task: Task, budget: Budget) -> ThresholdDetector:
        spec = task.detector
        return cls(spec.metric, spec.threshold, spec.above)

    def update(self, row: Mapping[str, float]) -> bool:
        value = row.get(self.metric, math.nan)
        if value is None or not math.isfinite(float(value)):
            return False
        return value > self.threshold if self.above else value < self.threshold


class Task:
    """A failure mode induced on purpose. Subclasses are one module each under `tasks/`.

    A subclass sets the class attributes below and implements `build`. The docstring of a subclass
    states the mechanism its calibration measured, not only the name of the failure mode.

    The rule every task follows: a failure mode matters because it stops or corrupts learning that should
    happen, so the post-onset phase holds something worth learning in both branches (a shifted problem, or
    a reward whose optimum is worth clearly more than the policy at onset). The control learns it, the
    injected baseline fails to, the matched fix learns it despite the injection, and a learner that does
    not learn (`no-update`, `frozen-at-onset`) fails. Normalized return is anchored on that: `return_floor`
    is what the policy frozen at onset earns on the post-onset objective, `return_ceiling` the post-onset
    optimum (or what the control reaches); both are fixed numbers per task version, and the docstring says
    how each was obtained (exactly, or measured once on named seeds).
    """

    id: ClassVar[str]
    family: ClassVar[str]  # "reasoning", "tools" or "grids"
    version: ClassVar[str] = "1"
    trainer: ClassVar[str]  # "ppo" or "grpo"
    budgets: ClassVar[Mapping[str, Budget]]
    ground_truth: ClassVar[GroundTruth]
    matched_fix: ClassVar[str]
    methods: ClassVar[tuple[str, ...]]  # named methods: baseline, the fix, named non-fixes (the matrix compares them)
    detector: ClassVar[DetectorSpec]
    diagnostics: ClassVar[tuple[str, ...]]  # diagnostic columns every row carries
    return_floor: ClassVar[float]  # fixed per task version: 0 = the policy frozen at onset, after onset ...
    return_ceiling: ClassVar[float]  # ... and 1 = the post-onset optimum (or the control's reach)
    # Columns a detector must not see beyond `return`, the `gt_*` columns and the ground-truth metric
    # (a held-out gold score, an exact quantity the practitioner cannot measure). A task that wants to
    # expose the training reward it observes adds its own column (for example `reward_observed`).
    privileged: ClassVar[tuple[str, ...]] = ()
    # What a detector reads (`suite.visibility`): `visible`, the task's diagnostic columns (default: the built-ins'
    # schema measured on the committed results, for a plugin every column not hidden); `configuration`, columns
    # that hold settings rather than measurements (hidden, beside `suite.visibility.CONFIGURATION`).
    visible: ClassVar[tuple[str, ...]] = ()
    configuration: ClassVar[tuple[str, ...]] = ()
    experimental: ClassVar[bool] = False
    # Batch keys and model capabilities this task adds to its trainer's schema (`Stabilizer.needs`): for
    # example a reward-model ensemble's predictions, or a policy that can bound its context.
    provides: ClassVar[frozenset[str]] = frozenset()
    # Optional: a dataclass of constructor knobs (`tasks.worlds.scaffold.OnsetKnobs` when the onset is the only
    # one). An `onset` field overrides the tiers' onsets (smoke excepted) and is checked here, the same way for
    # every task; other knobs are checked by the dataclass's optional `check(shortest_run)`, raising
    # StabenchError. The task then holds `self.knobs`.
    knobs_type: ClassVar[type | None] = None
    # The gymnasium environments the task defines: id -> entry point, or (entry point, default kwargs). An entry
    # point is an attribute of the task's own module ("ToolCallEnv") or "package.module:attribute". Read from
    # the source without importing the module (built-ins are registered at `import stabench`), so it must be
    # a literal.
    environments: ClassVar[Mapping[str, str | tuple[str, Mapping[str, Any]]]] = {}
    # The task's figures in the paper, and the paragraph (Markdown) the paper prints for it above them.
    figures: ClassVar[tuple[Figure, ...]] = ()
    paper: ClassVar[str] = ""

    def __init__(self, **knobs: Any) -> None:
        if self.knobs_type is None:
            if knobs:
                raise StabenchError(f"task {self.id!r} takes no knobs, got {', '.join(sorted(knobs))}")
            return
        from dataclasses import fields

        known = [f.name for f in fields(self.knobs_type)]
        unknown = sorted(set(knobs) - set(known))
        if unknown:
            raise StabenchError(f"{self.id}: unknown knob {', '.join(unknown)}; known: {', '.join(known)}")
        self.knobs = self.knobs_type(**knobs)
        shortest = min(b.iterations for tier, b in self.budgets.items() if tier != "smoke")
        onset = getattr(self.knobs, "onset", None)
        is_int = isinstance(onset, numbers.Integral) and not isinstance(onset, bool)
        if onset is not None and not (is_int and 0 < onset < shortest):
            raise StabenchError(
                f"{self.id}: onset must be an integer in 1..{shortest - 1} (inside every quick and full run), "
                f"got {onset!r}"
            )
        check = getattr(self.knobs, "check", None)
        if check is not None:
            check(shortest)

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> Run:
        raise NotImplementedError

    def grid(self, name: str, tier: str) -> list[dict[str, Any]]:
        """Knob settings of a named sweep over this task (each is `type(task)(**knobs)`); none by default."""
        raise StabenchError(f"task {self.id!r} has no grid named {name!r}")

    def budget(self, tier: str) -> Budget:
        if tier not in self.budgets:
            raise StabenchError(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
        base = self.budgets[tier]
        onset = getattr(getattr(self, "knobs", None), "onset", None)
        if onset is None or tier == "smoke":
            return base
        return Budget(base.iterations, onset, base.seeds, base.report_every)

    def default_methods(self) -> tuple[str, ...]:
        """What a sweep runs when no method is named: the baseline, the matched fix and both references, the runs a
        row is scored against. The task's other named methods (`methods`: plain guards, alternative fixes) run in the
        method matrix (`--matrix`, 10 seeds, where the paper compares them) or when named with `--methods`; this
        keeps every default task at 5 quick seeds within the quick tier's 10 minutes (bench/RESULTS.md, row 4)."""
        named = [m for m in self.methods if m in ("baseline", self.matched_fix)]
        return tuple(dict.fromkeys(("baseline", *named, *REFERENCE_METHODS)))

    def role(self, method: str) -> str:
        if method == "baseline":
            return "baseline"
        if method in REFERENCE_METHODS:
            return "reference"
        return "matched-fix" if method == self.matched_fix else "other"

    def normalized_return(self, value: float) -> float:
        return (value - self.return_floor) / (self.return_ceiling - self.return_floor)
