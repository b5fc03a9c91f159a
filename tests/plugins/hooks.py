"""A stabilizer for the contract tests of the `rollout` hook and the loss report (tests/test_contract.py), loaded by
file reference as a user's plugin is.

`RecordHooks` records every `rollout` call (what it received) and every `loss` call (the terms as floats), and
its `rollout` replaces the advantages by a constant that the trainer must then use.
"""

from __future__ import annotations

from typing import Any

import torch

from stabench import Stabilizer

ROLLOUT_ADVANTAGE = 0.25  # what `rollout` writes into every advantage


class RecordHooks(Stabilizer):
    name = "record-hooks"

    def __init__(self) -> None:
        self.rollout_calls: list[dict[str, Any]] = []  # per call: the batch's keys and shapes, the info's keys
        self.loss_terms: list[dict[str, float]] = []  # per `loss` call: each term as a float

    def rollout(self, batch: dict[str, torch.Tensor], info: Any) -> dict[str, torch.Tensor]:
        self.rollout_calls.append({"keys": frozenset(batch), "info": frozenset(info),
                                   "rows": len(batch["advantages"])})
        return {**batch, "advantages": torch.full_like(batch["advantages"], ROLLOUT_ADVANTAGE)}

    def loss(self, terms: dict[str, torch.Tensor], batch: Any) -> dict[str, torch.Tensor]:
        self.loss_terms.append({k: float(v.detach()) for k, v in terms.items()})
        return terms
