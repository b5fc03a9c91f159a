"""A toy task and plugins for harness tests: runs in milliseconds, with a failure that is known.

The "policy" is one scalar w trained by gradient steps toward a target. Healthy: target 1, return
= 1 - |w - 1|. At onset the injected variant receives gradients scaled by 50 (a scale shock), so
plain SGD overshoots and oscillates; `ToyFix` clips the gradient and keeps the return.
"""

from __future__ import annotations

import math

import torch
from stabench.suite.api import Budget, DetectorSpec, Diverged, GroundTruth, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import DIAGNOSTICS


class ToyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(self.w.weight)


class ToyRun:
    def __init__(self, seed: int, stabilizer: Stabilizer) -> None:
        self.stabilizer = stabilizer
        self.model = stabilizer.model(ToyModel(), {"width": 1})
        self.opt = stabilizer.optimizer(torch.optim.SGD(self.model.parameters(), lr=0.3), self.model)
        self.steps = 0

    def step(self, injected: bool) -> dict[str, float]:
        w = self.model.w.weight.squeeze()
        noise = 0.01 * torch.randn(())
        scale = 50.0 if injected else 1.0
        adv = self.stabilizer.advantages(torch.ones(1), {})
        terms = self.stabilizer.loss({"fit": scale * 0.5 * (w - 1.0 - noise) ** 2 * adv.mean()}, {})
        loss = sum(terms.values())
        if not torch.isfinite(loss):
            raise Diverged(f"loss {float(loss)}")
        self.opt.zero_grad()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}  # raw, before the hook
        self.stabilizer.after_backward(self.model)
        self.opt.step()
        self.steps += 10
        w = float(self.model.w.weight.detach())
        state = TrainState(self.model, {}, grads, {"fit": float(loss.detach())})
        row = {"step": self.steps, "return": 1.0 - min(abs(w - 1.0), 1.0), "entropy": math.nan, "w": w}
        row.update(DIAGNOSTICS["grad_norms"](state))
        return row


class ToyTask(Task):
    """Toy: a gradient-scale shock makes SGD oscillate (the mechanism is by construction)."""

    id = "toy"
    family = "grids"
    trainer = "toy"
    budgets = {
        "smoke": Budget(iterations=12, onset=4, seeds=2, report_every=4),
        "quick": Budget(iterations=30, onset=10, seeds=3),
        "full": Budget(iterations=60, onset=20, seeds=5),
    }
    ground_truth = GroundTruth(metric="return", threshold=0.5, fails_when="below", reduce="tail_mean", tail=0.25)
    matched_fix = "toy-fix"
    methods = ("baseline",)
    detector = DetectorSpec(metric="grad_norm_total", threshold=5.0)
    diagnostics = ("grad_norms",)
    return_floor = 0.0
    return_ceiling = 1.0

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> ToyRun:
        return ToyRun(seed, stabilizer)


class ToyFix(Stabilizer):
    """Clips the gradient norm to 0.5, which undoes the toy's scale shock."""

    name = "toy-fix"

    def after_backward(self, model: torch.nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


class Raising(Stabilizer):
    name = "raising"

    def advantages(self, advantages, batch):
        raise RuntimeError("boom")


class NaNLoss(Stabilizer):
    name = "nan-loss"

    def loss(self, terms, batch):
        return {**terms, "bad": torch.tensor(float("nan"))}


class WrongType(Stabilizer):
    name = "wrong-type"

    def advantages(self, advantages, batch):
        return advantages.tolist()


class NotAStabilizer:
    name = "not-a-stabilizer"


class NoOp(Stabilizer):
    """Every hook returns what it was given: a method that must score as the baseline does."""

    name = "no-op"

    def advantages(self, advantages, batch):
        return advantages

    def loss(self, terms, batch):
        return dict(terms)


class SlowRun(ToyRun):
    def step(self, injected: bool) -> dict[str, float]:
        import time

        time.sleep(0.1)  # long enough to kill a sweep in the middle of its trials
        return super().step(injected)


class SlowToyTask(ToyTask):
    """The toy, slowed down: about 3 s a trial at the quick tier, for kill-and-resume tests."""

    id = "slow-toy"

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> SlowRun:
        return SlowRun(seed, stabilizer)


class DieOnce(Stabilizer):
    """Kills its own worker process the first time a run is built with it (a marker file remembers),
    like a node that dies under a trial; Ray Tune should run the trial again."""

    name = "die-once"

    def model(self, model, spec):
        import os
        from pathlib import Path

        marker = Path(os.environ["STABENCH_TEST_MARKER"])
        if not marker.exists():
            marker.write_text("died once\n")
            os._exit(1)
        return model


class ClashingName(Stabilizer):
    name = "kl-max"  # a built-in's name: refused, results would be ambiguous
