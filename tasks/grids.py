"""Shared helpers for the MiniGrid ("grids") family of tasks.

A grid task sees MiniGrid's 7x7x3 egocentric view as one flat float vector (`ImgObsWrapper`, flattened,
divided by 10 so every entry lies in [0, 1]; 147 inputs) and acts with the first three MiniGrid actions
(turn left, turn right, forward), which are all an empty room needs.

Importing this module registers the flattened worlds under the `stabench/` namespace, for example
`gymnasium.make("stabench/EmptyFlat-5x5-v0")`. `make_vector_env` builds the training vector env: a
`SyncVectorEnv` with same-step autoreset whose sub-envs record true episode statistics *below* a
`RewardScale` wrapper, so a task can multiply the reward the learner sees (`vec.set_attr("reward_scale",
1000.0)`) while `info["final_info"]["episode"]["r"]` keeps reporting the true, unscaled return.
"""

from __future__ import annotations

from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from minigrid.envs import EmptyEnv
from minigrid.wrappers import ImgObsWrapper

N_ACTIONS = 3  # turn left, turn right, move forward
OBS_SCALE = 10.0  # largest MiniGrid object index is 10, so obs / 10 lies in [0, 1]


class FlatObs(gym.ObservationWrapper):
    """Flatten an image observation into a float32 vector and divide it by `OBS_SCALE`."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        n = int(np.prod(env.observation_space.shape))
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(n,), dtype=np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return (np.asarray(observation, dtype=np.float32).reshape(-1) / OBS_SCALE).astype(np.float32)


class FirstActions(gym.ActionWrapper):
    """Expose only the first `n` actions of a discrete action space (the indices are unchanged)."""

    def __init__(self, env: gym.Env, n: int = N_ACTIONS) -> None:
        super().__init__(env)
        self.action_space = gym.spaces.Discrete(n)

    def action(self, action: Any) -> int:
        return int(action)


class RewardScale(gym.RewardWrapper):
    """Multiply the reward by a mutable `reward_scale` (the injection of a reward-scale shock)."""

    def __init__(self, env: gym.Env, scale: float = 1.0) -> None:
        super().__init__(env)
        self.reward_scale = float(scale)

    def reward(self, reward: SupportsFloat) -> float:
        return float(reward) * self.reward_scale


def flatten_minigrid(env: gym.Env, n_actions: int = N_ACTIONS) -> gym.Env:
    """The family's observation and action interface around any MiniGrid env."""
    return FirstActions(FlatObs(ImgObsWrapper(env)), n_actions)


class StaticEmptyEnv(EmptyEnv):
    """MiniGrid's empty room, its observation memoized by (agent cell, heading).

    The room never changes and the agent carries nothing, so the egocentric view is a pure function of
    where the agent stands and faces; MiniGrid recomputes it on every step, which took three quarters of
    PPO's time here. The observations are MiniGrid's own (a test compares every cell and heading).
    """

    def gen_obs(self) -> dict[str, Any]:
        cache: dict[tuple[int, int, int], np.ndarray] = self.__dict__.setdefault("_view_cache", {})
        key = (int(self.agent_pos[0]), int(self.agent_pos[1]), int(self.agent_dir))
        image = cache.get(key)
        if image is None:
            image = cache[key] = super().gen_obs()["image"]
        return {"image": image.copy(), "direction": self.agent_dir, "mission": self.mission}


def make_empty_flat(size: int = 5, max_steps: int | None = None, render_mode: str | None = None) -> gym.Env:
    """MiniGrid's empty room (start top-left facing right, goal bottom-right) with the flat interface."""
    return flatten_minigrid(StaticEmptyEnv(size=size, max_steps=max_steps, render_mode=render_mode))


# Worlds registered at import: id -> (entry point, kwargs).
WORLDS: dict[str, tuple[Any, dict[str, Any]]] = {
    "stabench/EmptyFlat-5x5-v0": (make_empty_flat, {"size": 5}),
    "stabench/EmptyFlat-8x8-v0": (make_empty_flat, {"size": 8}),
}

for _id, (_entry, _kwargs) in WORLDS.items():
    if _id not in gym.registry:
        gym.register(id=_id, entry_point=_entry, kwargs=_kwargs)


def optimal_return_empty(size: int) -> float:
    """Best return of the empty room: 2(size-3)+1 steps (forward, turn, forward), reward 1 - 0.9 t / T."""
    steps = 2 * (size - 3) + 1
    return 1.0 - 0.9 * steps / (4 * size * size)


def make_env(env_id: str, reward_scale: float = 1.0, **kwargs: Any) -> gym.Env:
    """One training env: the registered world, true episode statistics, then the reward scale."""
    env = gym.make(env_id, disable_env_checker=True, **kwargs)
    env = gym.wrappers.RecordEpisodeStatistics(env)
    return RewardScale(env, reward_scale)


def make_vector_env(env_id: str, num_envs: int, reward_scale: float = 1.0, **kwargs: Any) -> gym.vector.SyncVectorEnv:
    """`num_envs` copies of `env_id` in a SyncVectorEnv that resets a finished env within the same step."""
    return gym.vector.SyncVectorEnv(
        [lambda: make_env(env_id, reward_scale, **kwargs) for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
