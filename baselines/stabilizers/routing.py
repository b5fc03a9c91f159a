"""Routing replay for Mixture-of-Experts policies (Zheng et al. 2025; Ma et al. 2025, "rollout routing replay").

A MoE token's probability is conditioned on the experts its routers chose. When the inference engine routes
a token differently from the learner (a near-tie broken the other way by another kernel), or the learner's
own routes move between minibatch updates, the importance ratio compares two different networks. Replay
fixes the expert set in every learner forward of an iteration and keeps the gate weights differentiable,
g_i = 1[i in S] e^{z_i} / sum_{j in S} e^{z_j}:

- `routing-replay` (R3): S = the engine's routes at sampling time; removes both the training-inference
  mismatch and the route staleness.
- `routing-replay-old` (R2): S = the routes the learner itself computed at the start of the update (pi_old);
  removes the staleness only.

The policy does the recording and replaying (a task that provides "route_replay" builds it); these
stabilizers only switch the mode, so they import no task.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from stabench.suite.api import Stabilizer
from torch import nn


class RolloutRoutingReplay(Stabilizer):
    name: ClassVar[str] = "routing-replay"
    needs: ClassVar[frozenset[str]] = frozenset({"route_replay"})
    mode: ClassVar[str] = "sampler"

    def model(self, model: nn.Module, spec: Mapping[str, Any]) -> nn.Module:
        model.route_replay = self.mode
        return model


class OldRoutingReplay(RolloutRoutingReplay):
    name: ClassVar[str] = "routing-replay-old"
    mode: ClassVar[str] = "old"
