"""Stabilizers for the contract tests (tests/test_contract.py), loaded by file reference as a user's plugin is.

`RecordAndSkip` records what every `loss` hook receives and then sets every gradient to None in
`after_backward`: "no update for that parameter" in every trainer. It needs nothing, so it applies everywhere.
"""

from __future__ import annotations

from typing import Any

import torch

from stabench import Stabilizer


class RecordAndSkip(Stabilizer):
    name = "record-and-skip"

    def __init__(self) -> None:
        self.loss_calls: list[dict[str, Any]] = []  # per `loss` call: its keys and which tensors carry a graph
        self.skipped = 0  # `after_backward` calls
        self.nonzero_grads_seen = 0  # `after_backward` calls where some gradient was non-zero before the skip

    def loss(self, terms: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
        self.loss_calls.append({
            "keys": frozenset(batch),
            "requires_grad": {k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.requires_grad},
            "terms": frozenset(terms),
        })
        return terms

    def after_backward(self, model: torch.nn.Module) -> None:
        self.skipped += 1
        if any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters()):
            self.nonzero_grads_seen += 1
        for p in model.parameters():
            p.grad = None
