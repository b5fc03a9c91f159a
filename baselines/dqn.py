"""DQN with a replay buffer and a target network, CleanRL-style: one file, read top to bottom, the math visible.

`DQN(envs, model, config, stabilizer).iterate()` performs one iteration:

1. collect `num_steps` x `num_envs` transitions from a gymnasium `SyncVectorEnv` built with
   `autoreset_mode=SAME_STEP`, acting epsilon-greedily on Q; epsilon falls linearly from `start_e` to `end_e`
   over the first `exploration_steps` env steps. With same-step autoreset the observation returned for a
   finished env is already the next episode's first one; the true last observation of the episode is
   `info["final_obs"]`, which is what the replay buffer stores as `next_obs`. Only `terminated` ends the
   bootstrap (a time-limit truncation bootstraps, unlike CleanRL's DQN, which treats it as terminal too);
2. store them in a ring replay buffer (numpy arrays inside the trainer, so `copy.deepcopy` branches it);
3. once `learning_starts` env steps have been collected, run `updates_per_iteration` gradient updates, each
   on a fresh uniform replay sample of `batch_size` transitions:
       y = r + gamma * (1 - terminated) * max_a' Q_target(s', a')          (no gradient through y)
       L_td = mean (Q(s, a) - y)^2                                          (CleanRL's mse_loss)
   The replay ratio is updates_per_iteration * batch_size / (num_steps * num_envs) samples per transition.
   After each update the target network moves as target <- tau * Q + (1 - tau) * target every
   `target_every` updates (tau = 1: CleanRL's periodic hard copy).

Stabilizer hooks are called in the order of `suite.api.Stabilizer`: `model` and `optimizer` once at
construction; per update `loss(terms, batch)` with terms {"td": L_td} -> backward -> `after_backward` ->
optimizer step. The per-update batch a `loss` hook receives holds obs, actions, rewards, next_obs,
terminated, td_target, and `ref_obs`: a second, independent uniform replay sample of `ref_batch_size`
observations that the TD loss never sees (CHAIN's reference batch). Gradient clipping is not part of the
trainer (the `grad-clip` stabilizer does it).

Randomness: epsilon-greedy draws, random actions and replay samples come from one `numpy.random.Generator`
held by the trainer, and the envs are seeded at construction, so the trainer's whole state lives in the
object and `copy.deepcopy` branches it (the model is built by the caller, under its own torch seed).

Held-out states: a caller may pass `heldout_obs` (S x obs_dim), a fixed probe set that the trainer never
trains on as such; it records Q on them before every update and after the last one, and which of them
happen to appear (as the same observation) in each update's TD batch, for churn diagnostics. When the
network is the plain `QNetwork` (no stabilizer replaced or hooked it), the held-out rows ride along in the
update's own forward pass (same parameters, one call instead of two); otherwise they get a forward of their own.

Speed (bench/RESULTS.md): Adam is torch's fused CPU kernel (one call for every parameter), an iteration runs
with subnormal floats flushed to zero (`iterate`), every update's replay indices are drawn at once.

What `iterate()` returns (`suite.api.TrainState`):
- `batch`: the iteration's last update's minibatch (the keys above); empty before learning starts;
- `grads`: each parameter's gradient on the last update, cloned right after backward, before the
  stabilizer's `after_backward` and the optimizer step;
- `losses`, DQN's subset of `suite.api.LOSS_SCHEMA`: means over the iteration's updates of `td_loss` (L_td),
  `q_mean` (mean Q(s, a) on the batch) and `loss` (the sum of all terms, stabilizers' included; NaN when no
  update ran), and `entropy`: the mean entropy of softmax(Q(s, .)) (temperature 1) over the observations the
  iteration acted on. That is the entropy of a Boltzmann policy over Q, a measure of the action gaps; the
  epsilon-greedy policy's own entropy is fixed by epsilon and says nothing about learning;
- `extras`: `loss_terms` (the last update's terms after the `loss` hook; empty when no update ran),
  `global_step` (env steps so far), `updates` (gradient updates so far), `epsilon`,
  `episode_return` (mean true undiscounted return of the episodes that ended during this iteration's
  collection, acting epsilon-greedily; NaN if none), `episodes` (their count), `updates_this_iteration`,
  `heldout_q`: a tensor (updates_this_iteration + 1) x S x n_actions of Q on the held-out states
  before each update and after the last; `heldout_in_batch`, a boolean tensor updates_this_iteration x S
  that marks the held-out states whose exact observation is in that update's TD batch; and `activations`:
  the network's hidden units on the held-out states after the last update (all three absent without
  held-out states; an iteration with no update has only the final Q in `heldout_q` and no mask).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from stabench.baselines import adam
from stabench.baselines.models import hooked, linear, sequential
from stabench.suite.api import Diverged, Stabilizer, TrainState
from torch import nn


@dataclass
class DQNConfig:
    num_envs: int = 8
    num_steps: int = 16  # env steps per env per iteration
    updates_per_iteration: int = 16  # gradient updates per iteration (once learning has started)
    batch_size: int = 64
    ref_batch_size: int = 64  # the independent reference sample exposed as batch["ref_obs"]
    buffer_size: int = 10_000
    learning_rate: float = 5e-4
    adam_eps: float = 1e-8
    gamma: float = 0.99
    tau: float = 1.0  # target <- tau * Q + (1 - tau) * target ...
    target_every: int = 64  # ... every this many updates
    start_e: float = 1.0
    end_e: float = 0.05
    exploration_steps: int = 2_000  # env steps over which epsilon falls linearly
    learning_starts: int = 256  # env steps before the first update
    seed: int = 0


ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


class QNetwork(nn.Module):
    """`depth` x (Linear -> activation) of `width` units, then a linear head with one Q-value per action.

    PyTorch's default Linear init. `spec["activation"]` is "relu" or "tanh".
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = dict(spec)
        dims = [spec["obs_dim"]] + [spec["width"]] * spec["depth"]
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b), ACTIVATIONS[spec.get("activation", "relu")]()]
        self.trunk = nn.Sequential(*layers)
        self.head = nn.Linear(dims[-1], spec["n_actions"])

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return linear(self.head, sequential(self.trunk, obs))  # the layers' kernels, without their __call__

    def hidden(self, obs: torch.Tensor) -> list[torch.Tensor]:
        """The trunk's post-activation hidden units (each batch x width), read by the `dormant` diagnostic."""
        acts, h = [], obs
        for layer in self.trunk:
            h = layer(h)
            if not isinstance(layer, nn.Linear):
                acts.append(h)
        return acts


def q_spec(obs_dim: int, n_actions: int, width: int = 64, depth: int = 2, activation: str = "relu") -> dict[str, Any]:
    return {"obs_dim": int(obs_dim), "n_actions": int(n_actions), "width": int(width), "depth": int(depth),
            "activation": activation}


def softmax_entropy(q: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(q) over the last axis (a Boltzmann policy over Q at temperature 1)."""
    logp = torch.log_softmax(q, dim=-1)
    return -(logp.exp() * logp).sum(-1)


class ReplayBuffer:
    """A ring buffer of transitions in preallocated numpy arrays; sampling draws from the trainer's generator."""

    def __init__(self, capacity: int, obs_dim: int) -> None:
        self.capacity, self.size, self.pos = capacity, 0, 0
        self.obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.next_obs = np.zeros((capacity, obs_dim), dtype=np.float32)
        self.actions = np.zeros(capacity, dtype=np.int64)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.terminated = np.zeros(capacity, dtype=np.float32)
        self.tag = np.full(capacity, -1, dtype=np.int64)  # a caller's label of each stored obs (-1: none)

    def add(self, obs: np.ndarray, action: np.ndarray, reward: np.ndarray, next_obs: np.ndarray,
            terminated: np.ndarray, tag: np.ndarray | None = None) -> None:
        idx = (self.pos + np.arange(len(obs))) % self.capacity
        self.obs[idx], self.actions[idx], self.rewards[idx] = obs, action, reward
        self.next_obs[idx], self.terminated[idx] = next_obs, terminated
        self.tag[idx] = -1 if tag is None else tag
        self.pos = int((self.pos + len(obs)) % self.capacity)
        self.size = min(self.size + len(obs), self.capacity)

    def draw(self, rng: np.random.Generator, n: int | tuple[int, ...]) -> np.ndarray:
        """Uniform indices of stored transitions, `n` of them (or an array of that shape)."""
        return rng.integers(0, self.size, n)

    def take(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """The transitions at `idx`, as the per-update batch's tensors."""
        return {
            "obs": torch.from_numpy(self.obs[idx]),
            "actions": torch.from_numpy(self.actions[idx]),
            "rewards": torch.from_numpy(self.rewards[idx]),
            "next_obs": torch.from_numpy(self.next_obs[idx]),
            "terminated": torch.from_numpy(self.terminated[idx]),
        }


class DQN:
    name = "dqn"

    def __init__(self, envs: gym.vector.SyncVectorEnv, model: nn.Module, config: DQNConfig,
                 stabilizer: Stabilizer | None = None, heldout_obs: torch.Tensor | None = None) -> None:
        self.envs, self.cfg = envs, config
        self.stabilizer = stabilizer if stabilizer is not None else Stabilizer()
        self.rng = np.random.default_rng(config.seed)
        self.model = self.stabilizer.model(model, getattr(model, "spec", {}))
        self.target = self._clone(self.model)
        self.sync_pairs = (list(self.target.parameters()), list(self.model.parameters()))  # the target's update
        # fused: one kernel for every parameter (a third of foreach's time on these small tensors)
        opt = torch.optim.Adam(self.model.parameters(), lr=config.learning_rate, eps=config.adam_eps, fused=True)
        self.optimizer = self.stabilizer.optimizer(opt, self.model)
        self.updates_per_iteration = config.updates_per_iteration

        obs, _ = envs.reset(seed=config.seed)
        self.next_obs = np.asarray(obs, dtype=np.float32)
        self.buffer = ReplayBuffer(config.buffer_size, self.next_obs.shape[1])
        self.heldout_obs = heldout_obs
        # exact-match lookup of held-out observations, to mark which of them each update's TD batch contains:
        # each distinct held-out observation is a group (aliased states share one), and the buffer stores the
        # group of every observation it holds (-1: not a held-out one), looked up once per transition
        self.heldout_group: dict[bytes, int] = {}
        members: list[list[int]] = []
        for i, row in enumerate(heldout_obs.numpy() if heldout_obs is not None else []):
            g = self.heldout_group.setdefault(row.tobytes(), len(members))
            if g == len(members):
                members.append([])
            members[g].append(i)
        self.group_members = np.zeros((len(members), len(heldout_obs) if heldout_obs is not None else 0), dtype=bool)
        for g, rows in enumerate(members):
            self.group_members[g, rows] = True
        self.global_step = 0
        self.updates = 0
        self.iteration = 0

    @staticmethod
    def _clone(model: nn.Module) -> nn.Module:
        target = copy.deepcopy(model)
        target.requires_grad_(False)
        return target

    # ---- the knobs of update intensity (a task may change them mid-run) ----------------------------------
    def set_intensity(self, updates_per_iteration: int | None = None, learning_rate: float | None = None) -> None:
        if updates_per_iteration is not None:
            self.updates_per_iteration = int(updates_per_iteration)
        if learning_rate is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = float(learning_rate)

    # ---- acting ------------------------------------------------------------------------------------------
    def epsilon(self) -> float:
        cfg = self.cfg
        frac = min(1.0, self.global_step / max(1, cfg.exploration_steps))
        return cfg.start_e + frac * (cfg.end_e - cfg.start_e)

    def act(self, q: torch.Tensor, epsilon: float) -> np.ndarray:
        """Epsilon-greedy: with probability epsilon a uniform action, else argmax_a Q (lowest index on ties)."""
        greedy = q.argmax(-1).numpy()
        explore = self.rng.random(len(greedy)) < epsilon
        random_actions = self.rng.integers(0, q.shape[-1], len(greedy))
        return np.where(explore, random_actions, greedy)

    # ---- one iteration -------------------------------------------------------------------------------------
    def iterate(self) -> TrainState:
        """One iteration, with subnormal floats flushed to zero (x86 FTZ/DAZ) while it runs: a dead unit's Adam
        moments decay into the subnormal range, whose arithmetic is many times slower (Adam's step took three times
        as long as on normal floats). Values below 1.2e-38 become 0; torch's default (no flush) is restored after."""
        torch.set_flush_denormal(True)
        try:
            return self._iterate()
        finally:
            torch.set_flush_denormal(False)

    def _iterate(self) -> TrainState:
        cfg, model = self.cfg, self.model
        ended: list[float] = []
        entropies: list[torch.Tensor] = []
        epsilon = self.epsilon()

        # 1-2. collect and store
        for _ in range(cfg.num_steps):
            epsilon = self.epsilon()
            obs = self.next_obs
            with torch.no_grad():
                q = model(torch.from_numpy(obs))
            entropies.append(softmax_entropy(q))
            actions = self.act(q, epsilon)
            next_obs, rewards, terminated, truncated, info = self.envs.step(actions)
            self.global_step += cfg.num_envs
            real_next = np.array(next_obs, dtype=np.float32, copy=True)
            done = np.logical_or(terminated, truncated)
            if done.any():  # same-step autoreset: the episode's last observation is in final_obs
                for i in np.flatnonzero(done):
                    real_next[i] = info["final_obs"][i]
                final = info["final_info"]
                ended.extend(float(r) for r in final["episode"]["r"][final["_episode"]])
            tag = None
            if self.heldout_group:
                tag = np.array([self.heldout_group.get(row.tobytes(), -1) for row in obs], dtype=np.int64)
            self.buffer.add(obs, actions, np.asarray(rewards, dtype=np.float32), real_next,
                            np.asarray(terminated, dtype=np.float32), tag)
            self.next_obs = np.asarray(next_obs, dtype=np.float32)

        # 3. updates
        n_updates = self.updates_per_iteration if self.global_step >= cfg.learning_starts else 0
        sums = {"td_loss": 0.0, "q_mean": 0.0, "loss": 0.0}
        grads: dict[str, torch.Tensor] = {}
        mb: dict[str, torch.Tensor] = {}
        terms: dict[str, torch.Tensor] = {}
        heldout: list[torch.Tensor] = []
        in_batch: list[torch.Tensor] = []
        # every update's replay sample is drawn at once: row u holds its TD batch, then its reference batch
        draws = self.buffer.draw(self.rng, (n_updates, cfg.batch_size + cfg.ref_batch_size)) if n_updates else None
        # the held-out states ride along in the TD forward (same parameters) when nothing but the plain network
        # sees the batch: no stabilizer's replacement model and no hook
        ride_along = (self.heldout_obs is not None and type(model) is QNetwork
                      and not any(hooked(m) for m in model.modules()))
        for u in range(n_updates):
            if self.heldout_obs is not None and not ride_along:
                with torch.no_grad():
                    heldout.append(model(self.heldout_obs))
            idx = draws[u, :cfg.batch_size]
            mb = self.buffer.take(idx)
            mb["ref_obs"] = torch.from_numpy(self.buffer.obs[draws[u, cfg.batch_size:]])
            if self.heldout_obs is not None:
                groups = self.buffer.tag[idx]
                in_batch.append(torch.from_numpy(self.group_members[groups[groups >= 0]].any(0)))
            with torch.no_grad():
                next_q = self.target(mb["next_obs"]).max(-1).values
                mb["td_target"] = mb["rewards"] + cfg.gamma * (1.0 - mb["terminated"]) * next_q
            if ride_along:
                q_all = model(torch.cat([mb["obs"], self.heldout_obs]))
                q, q_held = q_all.split([cfg.batch_size, len(self.heldout_obs)])
                heldout.append(q_held.detach())
            else:
                q = model(mb["obs"])
            q_sa = q.gather(-1, mb["actions"].unsqueeze(-1)).squeeze(-1)
            td_loss = (q_sa - mb["td_target"]).pow(2).mean()

            terms = self.stabilizer.loss({"td": td_loss}, mb)
            loss = sum(terms.values())
            loss_value = float(loss.detach())
            if not math.isfinite(loss_value):
                raise Diverged(f"non-finite DQN loss {loss_value} at iteration {self.iteration}")

            last = u == n_updates - 1  # only the last update's gradients are reported
            raw = adam.update(loss, model, self.optimizer, self.stabilizer, reported=last)
            grads = raw if last else grads
            self.updates += 1
            if self.updates % cfg.target_every == 0:
                with torch.no_grad():
                    torch._foreach_lerp_(*self.sync_pairs, cfg.tau)

            sums["td_loss"] += float(td_loss.detach())
            sums["q_mean"] += float(q_sa.detach().mean())
            sums["loss"] += loss_value

        for p in model.parameters():
            if not torch.isfinite(p).all():
                raise Diverged(f"non-finite parameters after iteration {self.iteration}")

        self.iteration += 1
        losses = {k: (v / n_updates if n_updates else math.nan) for k, v in sums.items()}
        losses["entropy"] = float(torch.cat(entropies).mean())
        extras: dict[str, Any] = {
            "loss_terms": {k: float(v.detach()) for k, v in terms.items()},
            "global_step": self.global_step,
            "updates": self.updates,
            "updates_this_iteration": n_updates,
            "epsilon": epsilon,
            "episode_return": float(np.mean(ended)) if ended else math.nan,
            "episodes": len(ended),
        }
        if self.heldout_obs is not None:
            with torch.no_grad():
                heldout.append(model(self.heldout_obs))
                if hasattr(model, "hidden"):
                    extras["activations"] = [a.detach() for a in model.hidden(self.heldout_obs)]
            extras["heldout_q"] = torch.stack(heldout)
            if in_batch:
                extras["heldout_in_batch"] = torch.stack(in_batch)
        return TrainState(model=model, batch=mb, grads=grads, losses=losses, extras=extras)
