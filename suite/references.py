"""Reference stabilizers: learners that do not learn, to anchor the floor of the stabilizer track.

Like `never` and `always` for detectors, they say what a score is worth: a task whose post-onset phase
demands learning must fail them, and a stabilizer that scores like them has stopped the learning the task
asks for rather than stabilized it.

- `no-update` never changes the policy: every gradient is dropped (set to `None`) after backward, so the
  optimizer skips every parameter (Adam and its relatives skip a parameter whose gradient is `None`).
- `frozen-at-onset` trains like the baseline until the onset iteration and stops there, in both branches.
  Stabilizers are never told the onset, so the harness (`suite.trial.run_trial`) switches it on in the
  branches it copies at onset; no plugin can take this route (the trial checks the built-in class).
"""

from __future__ import annotations

from typing import ClassVar

from stabench.suite.api import Stabilizer
from torch import nn


def drop_gradients(model: nn.Module) -> None:
    """No update for any parameter of `model` this step: its gradients become `None`."""
    for parameter in model.parameters():
        parameter.grad = None


class NoUpdate(Stabilizer):
    """Never takes an optimizer step on the policy: what the untrained (warm-started) policy earns."""

    name: ClassVar[str] = "no-update"

    def after_backward(self, model: nn.Module) -> None:
        drop_gradients(model)

    def drops_all_gradients(self) -> bool:
        return True


class FrozenAtOnset(Stabilizer):
    """The baseline until onset, then no optimizer step: what the policy frozen at onset earns.

    `frozen` is switched on by the harness in the branches copied at onset, never by the stabilizer.
    """

    name: ClassVar[str] = "frozen-at-onset"
    frozen: bool = False

    def after_backward(self, model: nn.Module) -> None:
        if self.frozen:
            drop_gradients(model)

    def drops_all_gradients(self) -> bool:
        return self.frozen
