"""Run pieces every task would otherwise write again: the onset knob, trailing windows and a GRPO run base."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from stabench.baselines.grpo import GRPO, GRPOConfig
from stabench.baselines.models import SameWeights
from stabench.suite.api import Budget, Stabilizer, TrainState
from stabench.suite.diagnostics import DiagnosedRun
from stabench.tasks.worlds.tokens import RewardFn
from torch import nn


@dataclass(frozen=True)
class OnsetKnobs:
    """The knob every task takes: `onset`, the first injected iteration at the quick and full tiers (None: the
    tier's own). `Task.__init__` checks it, for every task the same way."""

    onset: int | None = None


class Trailing:
    """One signal's history in a run, read through a trailing window: `push` appends this iteration's value.

    It lives inside the run object, so `copy.deepcopy` branches it with everything else.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.values: list[float] = []

    def push(self, value: float) -> float:
        """Append `value` and return it."""
        self.values.append(value)
        return value

    def mean(self) -> float:
        """The mean over the last `window` values (all of them while fewer)."""
        return float(np.mean(self.values[-self.window :]))

    def change(self) -> float:
        """The newest value less the one `window` iterations before it (the first value while fewer)."""
        return self.values[-1] - self.values[max(0, len(self.values) - 1 - self.window)]


class GRPORun(DiagnosedRun):
    """One seed of a GRPO task: the trainer (policy, frozen reference, Adam, sampler Generator) and the prompt
    Generator live here, so `copy.deepcopy` branches everything.

    A subclass writes its schedule (`reward`: which reward pays this iteration; `sampler`: which network samples
    the answers, None for the policy itself) and its row (`row`); the base draws `config.n_groups` prompts per
    iteration from `prompts`, and `DiagnosedRun.step` appends the task's diagnostics to the row. A row computes its
    exact evaluation through `self.evaluate(compute, policy, ...)`, which the references that stop learning pay once.
    """

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...], *,
                 warm: Callable[[], nn.Module], config: GRPOConfig, default_reward: RewardFn,
                 prompts: torch.Tensor) -> None:  # fmt: skip
        self.budget, self.diagnostics, self.prompts = budget, diagnostics, prompts
        reference = warm().eval().requires_grad_(False)
        self.trainer = GRPO(warm().train(), reference, default_reward, replace(config, seed=seed), stabilizer)
        self.prompt_rng = np.random.default_rng([seed, 1])
        # a row's exact evaluation of the policy, computed again only when the policy changed (`SameWeights`)
        self.evaluate = SameWeights()

    def reward(self, injected: bool, after_onset: bool) -> RewardFn:
        """The reward paying this iteration: the schedule of the task."""
        raise NotImplementedError

    def sampler(self, injected: bool, after_onset: bool) -> nn.Module | None:
        """The network that samples this iteration's answers (an inference engine); None: the policy itself."""
        return None

    def iterate(self, reward: RewardFn, prompts: torch.Tensor, sampler: nn.Module | None) -> TrainState:
        """One trainer iteration; a task wraps it to set state that holds only inside the update."""
        return self.trainer.iterate(reward, prompts, sampler=sampler)

    def row(self, state: TrainState, injected: bool) -> dict[str, float]:
        """The task's columns after one iteration (`step`, `return`, `entropy`, its ground truth, ...)."""
        raise NotImplementedError

    def train(self, injected: bool) -> tuple[dict[str, float], TrainState]:
        which = self.prompt_rng.integers(len(self.prompts), size=self.trainer.config.n_groups)
        after_onset = self.trainer.iteration >= self.budget.onset
        engine = self.sampler(injected, after_onset)
        state = self.iterate(self.reward(injected, after_onset), self.prompts[which], engine)
        row = self.row(state, injected)
        return row, state
