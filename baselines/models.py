"""Actor-critic networks for the vector-observation trainers: a trunk shared by a policy and a value head.

Every model here has the same interface, which the PPO trainer and the diagnostics rely on:

- `forward(obs) -> (logits, value)`: obs is batch x obs_dim, logits batch x n_actions, value batch;
- `hidden(obs) -> list[Tensor]`: the trunk's post-activation hidden units (each batch x units), read by
  the `dormant` diagnostic;
- `spec`: a dict (obs_dim, n_actions, width, depth) that stabilizers receive to build a replacement.

`PlainMLP` is the deep plain network of the grids family: `depth` Linear layers of `width` units, each
followed by ReLU, He-normal (Kaiming, fan-in) weights and zero biases. With PyTorch's default init a
16-layer plain net is broken from the start (first-layer gradients ~1e-8, features of rank 1); He init
keeps the forward signal at a constant scale through depth.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, the same kernel without `nn.Module.__call__` when nothing hooks the layer: a tiny network's
    forward is mostly that call's Python (the rollout runs one forward per env step)."""
    hooks = nn.modules.module  # the checks of `hooked`, inline: this runs once per layer per env step
    if (type(layer) is not nn.Linear or layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks
            or layer._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
            or hooks._global_backward_hooks or hooks._global_backward_pre_hooks):
        return layer(x)
    return F.linear(x, layer.weight, layer.bias)


def hooked(module: nn.Module) -> bool:
    """Whether a call of `module` would run hooks (its own or the global ones)."""
    hooks = nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def sequential(seq: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`seq(x)` for an `nn.Sequential` of Linear, Tanh and ReLU layers, the same kernels in the same order without
    each module's `__call__` where nothing hooks it (a tool task's MLP is called thousands of times per trial).
    Anything else (a wrapped or parametrized model, another layer type, a hook) is called as usual."""
    if type(seq) is not nn.Sequential or hooked(seq):
        return seq(x)
    for layer in seq:
        kind = type(layer)
        if kind is nn.Linear:
            x = linear(layer, x)
        elif kind is nn.Tanh and not hooked(layer):
            x = torch.tanh(x)
        elif kind is nn.ReLU and not layer.inplace and not hooked(layer):
            x = F.relu(x)
        else:
            x = layer(x)
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (0.0 and -0.0 differ, a NaN equals the same NaN), not just equal as numbers."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class SameWeights:
    """`memo(compute, model, *args)` is `compute(model, *args)`, or its last value while the model's parameters and
    buffers are bit for bit those it was computed on and `args` (and `key`) are equal.

    The references `no-update` and `frozen-at-onset` evaluate one unchanged policy at every iteration; a task's
    exact evaluation (an enumeration, often half of a trial) is then computed once. Every number is the one a
    recomputation would give: the weights are compared by their bits, not by a version counter (a stabilizer
    may write `.data`). `key` must hold whatever else the evaluation reads that is not an argument (a model
    attribute).
    """

    def __init__(self) -> None:
        self._state: list[torch.Tensor] | None = None
        self._key: Any = None
        self._value: Any = None

    def __call__(self, compute: Callable[..., Any], model: nn.Module, *args: Any, key: Any = None) -> Any:
        state = [t.detach() for t in (*model.parameters(), *model.buffers())]
        inputs = (args, key)
        if (self._state is not None and inputs == self._key and len(state) == len(self._state)
                and all(_same_bits(a, b) for a, b in zip(state, self._state))):
            return self._value
        value = compute(model, *args)
        self._state, self._key, self._value = [t.clone() for t in state], inputs, value
        return value


def he_linear(n_in: int, n_out: int) -> nn.Linear:
    """A Linear layer with He-normal weights (std sqrt(2 / n_in)) and zero bias."""
    layer = nn.Linear(n_in, n_out)
    nn.init.kaiming_normal_(layer.weight, mode="fan_in", nonlinearity="relu")
    nn.init.zeros_(layer.bias)
    return layer


def make_spec(obs_dim: int, n_actions: int, width: int = 64, depth: int = 16) -> dict[str, Any]:
    return {"obs_dim": int(obs_dim), "n_actions": int(n_actions), "width": int(width), "depth": int(depth)}


POLICY_GAIN = 0.01  # CleanRL's policy head: a near-uniform initial policy


def init_head(head: nn.Linear, gain: float, generator: torch.Generator | None = None) -> None:
    """CleanRL's head init, in place: orthogonal weights of `gain`, zero bias (`generator`: None, the global one)."""
    with torch.no_grad():
        nn.init.orthogonal_(head.weight, gain, generator=generator)
        nn.init.zeros_(head.bias)


class ActorCritic(nn.Module):
    """Base class: subclasses build the trunk, call `_heads`, and define `hidden` (and a faster `features`)."""

    spec: dict[str, Any]

    def _heads(self, width: int, n_actions: int) -> None:
        self.policy, self.value = nn.Linear(width, n_actions), nn.Linear(width, 1)
        init_head(self.policy, POLICY_GAIN)
        init_head(self.value, 1.0)

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        return self.hidden(obs)[-1]

    def hidden(self, obs: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.features(obs)
        return linear(self.policy, z), linear(self.value, z).squeeze(-1)


class PlainMLP(ActorCritic):
    """`depth` x (Linear -> ReLU) trunk of `width` units, then a policy head and a value head."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = dict(spec)
        width, depth = spec["width"], spec["depth"]
        dims = [spec["obs_dim"]] + [width] * depth
        self.layers = nn.ModuleList(he_linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self._heads(width, spec["n_actions"])

    def hidden(self, obs: torch.Tensor) -> list[torch.Tensor]:
        acts, h = [], obs
        for layer in self.layers:
            h = torch.relu(linear(layer, h))
            acts.append(h)
        return acts

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        h = obs
        for layer in self.layers:
            h = torch.relu(linear(layer, h))
        return h


class MultiSkipResidualMLP(ActorCritic):
    """Multi-skip residual trunk (Creus Castanyer et al. 2025), with the same heads and interface.

        x0  = LN(W_in obs)
        x_k = Block(x_{k-1}) + x_{k-1} + x0,   Block = ReLU -> Linear -> LN -> ReLU -> Linear -> LN
        z   = ReLU(x_K)  -> policy head, value head

    K = (depth - 1) // 2 blocks, so the trunk has 1 + 2K Linear layers (15 for depth 16): about as many as
    the plain net. The global skip from x0 into every block keeps a short gradient path to the input.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = dict(spec)
        width, blocks = spec["width"], max(1, (spec["depth"] - 1) // 2)
        self.inp = he_linear(spec["obs_dim"], width)
        self.inp_norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {"fc1": he_linear(width, width), "ln1": nn.LayerNorm(width),
                 "fc2": he_linear(width, width), "ln2": nn.LayerNorm(width)}
            )
            for _ in range(blocks)
        )
        self._heads(width, spec["n_actions"])

    def _trunk(self, obs: torch.Tensor, keep: list[torch.Tensor] | None) -> torch.Tensor:
        x0 = self.inp_norm(self.inp(obs))
        x = x0
        for b in self.blocks:
            a1 = torch.relu(x)
            a2 = torch.relu(b["ln1"](b["fc1"](a1)))
            x = b["ln2"](b["fc2"](a2)) + x + x0
            if keep is not None:
                keep.extend((a1, a2))
        z = torch.relu(x)
        if keep is not None:
            keep.append(z)
        return z

    def hidden(self, obs: torch.Tensor) -> list[torch.Tensor]:
        keep: list[torch.Tensor] = []
        self._trunk(obs, keep)
        return keep

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        return self._trunk(obs, None)
