"""An example stabilizer in one file: skip the update when the gradient norm spikes.

A loss spike (a rare huge advantage, a ratio far out of range) shows up as a gradient far longer than usual;
skipping that one update is a common guard. It needs no batch key (`needs` stays empty), only the
`after_backward` hook every trainer calls, so it runs on every task. The contract says how to skip:
a gradient set to `None` means "no update for that parameter" in every trainer.

    stabench run --tier quick --stabilizer examples/my_stabilizer.py:SpikeSkip
"""

import math

import torch

from stabench import Stabilizer


class SpikeSkip(Stabilizer):
    name = "spike-skip"
    version = "1"
    factor = 4.0  # skip when the norm exceeds factor x its running mean
    decay = 0.9  # of the running mean (over the updates that were taken)

    def __init__(self) -> None:
        self.mean_norm = math.nan
        self.skipped = 0

    def after_backward(self, model: torch.nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        if math.isfinite(self.mean_norm) and norm > self.factor * self.mean_norm:
            for p in model.parameters():
                p.grad = None  # no update this step
            self.skipped += 1
            return
        self.mean_norm = norm if math.isnan(self.mean_norm) else self.decay * self.mean_norm + (1 - self.decay) * norm
