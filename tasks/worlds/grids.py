"""Shared helpers for the MiniGrid ("grids") family of tasks.

A grid task sees MiniGrid's 7x7x3 egocentric view as one flat float vector (`ImgObsWrapper`, flattened,
divided by 10 so every entry lies in [0, 1]; 147 inputs) and acts with the first three MiniGrid actions
(turn left, turn right, forward), which are all an empty room needs.

`WORLDS` are the flattened rooms the PPO grid tasks train on, registered under the `stabench/` namespace (the
dead-layers task declares them), for example `gymnasium.make("stabench/EmptyFlat-5x5-v0")`: MiniGrid's empty
room stepped from a table of MiniGrid's own views and transitions (`EmptyRoomFlat`, equal to
`flatten_minigrid(EmptyEnv(...))` bit for bit; entry point `make_empty_flat`).
`make_vector_env` builds the training vector env, which resets a finished env within the same step and
records true episode statistics *below* the reward scale, so a task can multiply the reward the learner sees
(`vec.set_attr("reward_scale", 1000.0)`) while `info["final_info"]["episode"]["r"]` keeps reporting the true,
unscaled return: for the empty rooms a `RoomVectorEnv`, which steps every env in numpy, else a `SyncVectorEnv`
of `make_env` (a `RewardScale` wrapper over `RecordEpisodeStatistics`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
import torch
from minigrid.core.world_object import Goal
from minigrid.envs import EmptyEnv
from minigrid.wrappers import ImgObsWrapper

N_ACTIONS = 3  # turn left, turn right, move forward
OBS_SCALE = 10.0  # largest MiniGrid object index is 10, so obs / 10 lies in [0, 1]
# The empty rooms the PPO grid tasks train on (flattened MiniGrid rooms, `make_empty_flat`).
WORLDS: tuple[str, ...] = ("stabench/EmptyFlat-5x5-v0", "stabench/EmptyFlat-8x8-v0")


def flat_view(image: np.ndarray) -> np.ndarray:
    """MiniGrid's image observation as the family's float32 vector in [0, 1]."""
    return np.asarray(image, dtype=np.float32).reshape(-1) / OBS_SCALE


class FlatObs(gym.ObservationWrapper):
    """Flatten an image observation into a float32 vector and divide it by `OBS_SCALE`."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        n = int(np.prod(env.observation_space.shape))
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=(n,), dtype=np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return flat_view(observation)


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


@dataclass(frozen=True)
class RoomTable:
    """Every (cell, direction) of the empty room: its flat observation and deterministic transitions.

    Built by driving the real MiniGrid env from each state with each action. `next_state[s, a]` is the
    successor's index, -1 when the action steps onto the goal (the episode ends with reward 1 - 0.9 t / T);
    `goal_obs[s]` is the view after that step (agent on the goal, heading kept; zeros where no action of s
    reaches the goal).
    """

    obs: torch.Tensor  # S x 147
    next_state: np.ndarray  # S x A
    start: int
    max_steps: int
    goal_obs: np.ndarray  # S x 147
    cells: tuple[tuple[int, int, int], ...]  # state index -> (x, y, heading)

    def evaluate(self, logits: torch.Tensor) -> tuple[float, float]:
        """Exact expected return of the stochastic policy softmax(logits[s]) from the start, and its entropy
        averaged over the states it visits (occupancy-weighted), by forward dynamic programming over time."""
        logp = torch.log_softmax(logits.double(), -1)
        pi = logp.exp().numpy()
        ent = -(logp.exp() * logp).sum(-1).numpy()
        n = len(pi)
        goal = self.next_state < 0
        succ = np.maximum(self.next_state, 0)
        d = np.zeros(n)
        d[self.start] = 1.0
        ret = visits = ent_sum = 0.0
        for t in range(self.max_steps):
            visits += d.sum()
            ent_sum += float(d @ ent)
            flow = d[:, None] * pi  # S x A
            ret += float(flow[goal].sum()) * (1.0 - 0.9 * (t + 1) / self.max_steps)
            d = np.bincount(succ[~goal], weights=flow[~goal], minlength=n)
        return ret, ent_sum / visits

    def optimal_return(self) -> float:
        n = len(self.obs)
        dist = np.full(n, math.inf)
        for _ in range(n + 1):
            after = np.where(self.next_state < 0, 0.0, dist[np.maximum(self.next_state, 0)])
            dist = np.minimum(dist, (1.0 + after).min(1))
        t = dist[self.start]
        return float(1.0 - 0.9 * t / self.max_steps) if t <= self.max_steps else 0.0


_TABLES: dict[tuple[int, int, tuple[int, int]], RoomTable] = {}


def default_goal(size: int) -> tuple[int, int]:
    """MiniGrid's goal cell of the empty room: the bottom-right corner of the interior."""
    return (size - 2, size - 2)


def place_goal(env: EmptyEnv, goal: tuple[int, int]) -> None:
    """Move the goal of a reset MiniGrid empty room from its corner to the interior cell `goal`."""
    size = env.width
    if not (1 <= goal[0] <= size - 2 and 1 <= goal[1] <= size - 2) or tuple(goal) == tuple(env.agent_pos):
        raise ValueError(f"goal {goal} is not a free interior cell of the {size}x{size} room")
    env.grid.set(*default_goal(size), None)
    env.grid.set(int(goal[0]), int(goal[1]), Goal())


def room_table(size: int, max_steps: int, goal: tuple[int, int] | None = None) -> RoomTable:
    """The table of MiniGrid's empty `size` x `size` room, built once per process. `goal` moves the goal to
    another interior cell (opt-in; None keeps MiniGrid's bottom-right corner)."""
    goal = default_goal(size) if goal is None else (int(goal[0]), int(goal[1]))
    key = (size, max_steps, goal)
    if key not in _TABLES:
        env = EmptyEnv(size=size, max_steps=max_steps)
        env.reset(seed=0)
        if goal != default_goal(size):
            place_goal(env, goal)
        start = (int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir))
        states = [(x, y, d) for y in range(1, size - 1) for x in range(1, size - 1) for d in range(4)
                  if env.grid.get(x, y) is None]
        index = {s: i for i, s in enumerate(states)}
        obs, nxt = [], np.zeros((len(states), N_ACTIONS), dtype=np.int64)
        goal_obs = np.zeros((len(states), int(np.prod(env.observation_space["image"].shape))), dtype=np.float32)
        for i, (x, y, d) in enumerate(states):
            env.agent_pos, env.agent_dir, env.step_count = (x, y), d, 0
            obs.append(flat_view(env.gen_obs()["image"]))
            for a in range(N_ACTIONS):
                env.agent_pos, env.agent_dir, env.step_count = (x, y), d, 0
                view, _, terminated, _, _ = env.step(a)
                if terminated:
                    nxt[i, a], goal_obs[i] = -1, flat_view(view["image"])
                else:
                    nxt[i, a] = index[(int(env.agent_pos[0]), int(env.agent_pos[1]), env.agent_dir)]
        _TABLES[key] = RoomTable(torch.as_tensor(np.stack(obs)), nxt, index[start], max_steps, goal_obs,
                                tuple(states))
    return _TABLES[key]


class EmptyRoomFlat(gym.Env):
    """MiniGrid's empty room behind the family's flat interface, stepped from its `RoomTable`.

    Observations, rewards (MiniGrid's 1 - 0.9 * (t / T) on reaching the goal), termination and truncation
    are those of `flatten_minigrid(EmptyEnv(...))` bit for bit (a test steps both side by side); MiniGrid
    re-renders its egocentric view and passes it through three wrappers on every step, which took most of
    the environment's share of PPO's time. Rendering places a MiniGrid room in the same state and draws it.

    Opt-in: `goal` puts the goal on another interior cell, and `change_room(goal, max_steps)` switches the
    room (goal cell and timeout) from the next `reset` on, so an episode under way ends in the room it began.
    """

    metadata = {"render_modes": ["human", "rgb_array"], "render_fps": 10}

    def __init__(self, size: int = 5, max_steps: int | None = None, render_mode: str | None = None,
                 goal: tuple[int, int] | None = None) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r} is not one of {self.metadata['render_modes']}")
        self.size, self.render_mode = size, render_mode
        self.max_steps = 4 * size * size if max_steps is None else int(max_steps)  # MiniGrid's default
        self.goal = default_goal(size) if goal is None else (int(goal[0]), int(goal[1]))
        self.table = room_table(size, self.max_steps, self.goal)
        self._obs = self.table.obs.numpy()
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=self._obs.shape[1:], dtype=np.float32)
        self.action_space = gym.spaces.Discrete(N_ACTIONS)
        self.state, self.step_count, self.heading = self.table.start, 0, 0
        self._painter: EmptyEnv | None = None
        self._next_room: tuple[tuple[int, int], int] | None = None

    @property
    def agent_pos(self) -> tuple[int, int]:
        """The agent's cell, as MiniGrid's attribute (the goal's once reached)."""
        return tuple(self.goal) if self.state < 0 else self.table.cells[self.state][:2]

    @property
    def agent_dir(self) -> int:
        """The agent's heading, as MiniGrid's attribute (0 right, 1 down, 2 left, 3 up)."""
        return self.heading if self.state < 0 else self.table.cells[self.state][2]

    def change_room(self, goal: tuple[int, int], max_steps: int | None = None) -> None:
        """From the next `reset` on, the goal stands on `goal` and episodes time out after `max_steps`."""
        goal = (int(goal[0]), int(goal[1]))
        max_steps = self.max_steps if max_steps is None else int(max_steps)
        room_table(self.size, max_steps, goal)  # validates the goal cell now
        self._next_room = (goal, max_steps)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)  # the room is deterministic: the seed only seeds `np_random`
        if self._next_room is not None:
            (self.goal, self.max_steps), self._next_room = self._next_room, None
            self.table = room_table(self.size, self.max_steps, self.goal)
            self._obs = self.table.obs.numpy()
            self.close()  # the painter draws the room it was built for
        self.state, self.step_count = self.table.start, 0
        if self.render_mode == "human":
            self.render()
        return self._obs[self.state].copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        a = int(action)
        if not 0 <= a < N_ACTIONS:
            raise ValueError(f"action {action!r} is not one of the room's {N_ACTIONS} actions")
        if self.state < 0:
            raise RuntimeError("the agent stands on the goal: call reset() before stepping again")
        self.step_count += 1
        nxt = int(self.table.next_state[self.state, a])
        truncated = self.step_count >= self.max_steps  # as MiniGrid: also on a goal reached at the last step
        if nxt < 0:
            obs, self.heading, self.state = self.table.goal_obs[self.state].copy(), self.table.cells[self.state][2], -1
            reward, terminated = 1 - 0.9 * (self.step_count / self.max_steps), True
        else:
            obs, self.state, reward, terminated = self._obs[nxt].copy(), nxt, 0.0, False
        if self.render_mode == "human":
            self.render()
        return obs, reward, terminated, truncated, {}

    def render(self) -> np.ndarray | None:
        if self.render_mode is None:
            return None
        if self._painter is None:
            self._painter = EmptyEnv(size=self.size, max_steps=self.max_steps, render_mode=self.render_mode)
            self._painter.reset(seed=0)
            if self.goal != default_goal(self.size):
                place_goal(self._painter, self.goal)
        x, y, d = (*self.goal, self.heading) if self.state < 0 else self.table.cells[self.state]
        self._painter.agent_pos, self._painter.agent_dir = (x, y), d
        self._painter.step_count = self.step_count
        return self._painter.render()

    def close(self) -> None:
        if self._painter is not None:
            self._painter.close()
            self._painter = None


class RandomStartRoomFlat(EmptyRoomFlat):
    """MiniGrid's empty room with a uniformly random start cell and direction (`EmptyEnv(agent_start_pos=None)`),
    stepped from its `RoomTable` like `EmptyRoomFlat`.

    `reset` draws the start from `np_random` with MiniGrid's own calls in MiniGrid's order (`place_agent`:
    rejection sampling of a cell over the whole grid, x then y, until the cell is empty, then a direction), so a
    seeded run starts where `flatten_minigrid(EmptyEnv(size, agent_start_pos=None, ...))` starts, episode after
    episode; the goal stays in its corner (`change_room` is not offered).
    """

    def __init__(self, size: int = 5, max_steps: int | None = None, render_mode: str | None = None) -> None:
        super().__init__(size=size, max_steps=max_steps, render_mode=render_mode)
        self.index = {cell: i for i, cell in enumerate(self.table.cells)}

    def change_room(self, goal: tuple[int, int], max_steps: int | None = None) -> None:
        raise NotImplementedError("the random-start room keeps MiniGrid's goal")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        gym.Env.reset(self, seed=seed)
        rng = self.np_random
        while True:  # MiniGridEnv.place_obj(None): top (0, 0), size the whole grid; a wall or the goal: again
            x, y = int(rng.integers(0, self.size)), int(rng.integers(0, self.size))
            if (x, y, 0) in self.index:
                break
        self.state, self.step_count = self.index[(x, y, int(rng.integers(0, 4)))], 0
        if self.render_mode == "human":
            self.render()
        return self._obs[self.state].copy(), {}


def make_empty_flat(size: int = 5, max_steps: int | None = None, render_mode: str | None = None,
                    goal: tuple[int, int] | None = None) -> gym.Env:
    """MiniGrid's empty room (start top-left facing right, goal bottom-right unless `goal` says another
    interior cell) with the flat interface."""
    return EmptyRoomFlat(size=size, max_steps=max_steps, render_mode=render_mode, goal=goal)


def optimal_return_empty(size: int) -> float:
    """Best return of the empty room: 2(size-3)+1 steps (forward, turn, forward), reward 1 - 0.9 t / T."""
    steps = 2 * (size - 3) + 1
    return 1.0 - 0.9 * steps / (4 * size * size)


def make_env(env_id: str, reward_scale: float = 1.0, **kwargs: Any) -> gym.Env:
    """One training env: the registered world, true episode statistics, then the reward scale."""
    env = gym.make(env_id, disable_env_checker=True, **kwargs)
    env = gym.wrappers.RecordEpisodeStatistics(env)
    return RewardScale(env, reward_scale)


class RoomVectorEnv(gym.vector.VectorEnv):
    """`num_envs` empty rooms stepped together from their `RoomTable`s, in numpy.

    The same observations, rewards, termination, truncation and episode statistics as `num_envs`
    `make_env(..., make_empty_flat)` in a `SyncVectorEnv` with same-step autoreset (tests step both side by
    side): a finished env starts its next episode within the same step, `info["final_info"]["episode"]["r"/"l"]`
    under the mask `info["final_info"]["_episode"]` reports the true, unscaled return, and the reward the learner
    sees is multiplied by `reward_scale`. The synchronous wrapper stack cost 20 us per env step in Python (a
    fifth of PPO's time on the benchmark world); this steps all envs in a handful of array operations.

    `call("change_room", goal, max_steps)`, `set_attr("reward_scale", x)` and `get_attr` do what they do on the
    SyncVectorEnv: each env switches room at its next reset, so an episode under way ends in the room it
    began. Not offered: `final_obs` (no trainer reads it) and rendering.
    """

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int, size: int = 5, max_steps: int | None = None,
                 goal: tuple[int, int] | None = None, reward_scale: float = 1.0) -> None:
        self.num_envs, self.size, self.reward_scale = num_envs, size, float(reward_scale)
        max_steps = 4 * size * size if max_steps is None else int(max_steps)  # MiniGrid's default
        goal = default_goal(size) if goal is None else (int(goal[0]), int(goal[1]))
        self.rooms = [room_table(size, max_steps, goal)]
        self.goals = [goal]  # each room's goal cell
        self.room = np.zeros(num_envs, dtype=np.int64)  # each env's room (index into `rooms`)
        self.next_room = np.full(num_envs, -1, dtype=np.int64)  # the room from the env's next reset on
        self.single_observation_space = gym.spaces.Box(0.0, 1.0, shape=tuple(self.rooms[0].obs.shape[1:]),
                                                       dtype=np.float32)
        self.single_action_space = gym.spaces.Discrete(N_ACTIONS)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self._obs = [room.obs.numpy() for room in self.rooms]
        self.state = np.full(num_envs, self.rooms[0].start, dtype=np.int64)
        self.t = np.zeros(num_envs, dtype=np.int64)
        self.ret = np.zeros(num_envs)
        self.single = 0  # the room every env is in, -1 while they are in different rooms

    @staticmethod
    def reward(t: np.ndarray, max_steps: int) -> np.ndarray:
        """MiniGrid's success reward after `t` steps: 1 - 0.9 * (t / T), in MiniGrid's order of operations."""
        return 1 - 0.9 * (t / max_steps)

    def change_room(self, goal: tuple[int, int], max_steps: int | None = None) -> None:
        """From each env's next reset on, the goal stands on `goal` and episodes time out after `max_steps`."""
        max_steps = self.rooms[0].max_steps if max_steps is None else int(max_steps)
        table = room_table(self.size, max_steps, (int(goal[0]), int(goal[1])))  # validates the goal cell now
        known = [i for i, room in enumerate(self.rooms) if room is table]  # tables are built once per process
        if not known:
            self.rooms.append(table)
            self.goals.append((int(goal[0]), int(goal[1])))
            self._obs.append(table.obs.numpy())
        self.next_room[:] = known[0] if known else len(self.rooms) - 1

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """`SyncVectorEnv.call` for the room's one method (`change_room`): applies to every env."""
        if name != "change_room":
            raise AttributeError(f"RoomVectorEnv offers call('change_room', ...) only, not {name!r}")
        self.change_room(*args, **kwargs)
        return (None,) * self.num_envs

    def set_attr(self, name: str, values: Any) -> None:
        """`SyncVectorEnv.set_attr` for the wrapper's one attribute (`reward_scale`), one value for every env."""
        if name != "reward_scale" or isinstance(values, (list, tuple)):
            raise AttributeError(f"RoomVectorEnv sets one reward_scale for every env, not {name!r}={values!r}")
        self.reward_scale = float(values)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """`SyncVectorEnv.get_attr` for `goal`, `max_steps` (of each env's current room) and `reward_scale`."""
        if name == "goal":
            return tuple(self.goals[r] for r in self.room)
        if name == "max_steps":
            return tuple(self.rooms[r].max_steps for r in self.room)
        if name == "reward_scale":
            return (self.reward_scale,) * self.num_envs
        raise AttributeError(f"RoomVectorEnv reports goal, max_steps and reward_scale, not {name!r}")

    def _start(self, envs: np.ndarray) -> None:
        """Begin a new episode in `envs` (a boolean mask), in the room each is switching to, if any."""
        switch = envs & (self.next_room >= 0)
        self.room[switch], self.next_room[switch] = self.next_room[switch], -1
        for r in np.unique(self.room[envs]):
            self.state[envs & (self.room == r)] = self.rooms[r].start
        self.t[envs], self.ret[envs] = 0, 0.0
        self.single = int(self.room[0]) if (self.room == self.room[0]).all() else -1

    def _observe(self) -> np.ndarray:
        if self.single >= 0:
            return self._obs[self.single][self.state]
        obs = np.empty((self.num_envs,) + self.single_observation_space.shape, dtype=np.float32)
        for r in np.unique(self.room):
            mask = self.room == r
            obs[mask] = self._obs[r][self.state[mask]]
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        self._start(np.ones(self.num_envs, dtype=bool))  # the rooms are deterministic: the seed changes nothing
        return self._observe(), {}

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        actions = np.asarray(actions, dtype=np.int64)
        if actions.shape != (self.num_envs,) or (actions.view(np.uint64) >= N_ACTIONS).any():  # negatives too
            raise ValueError(f"expected {self.num_envs} actions in 0..{N_ACTIONS - 1}, got {actions!r}")
        self.t += 1
        if self.single >= 0:  # every env in one room: no per-room masks
            room = self.rooms[self.single]
            nxt = room.next_state[self.state, actions]
            truncated = self.t >= room.max_steps  # as MiniGrid: also on a goal reached at the last step
            true_reward = np.where(nxt < 0, self.reward(self.t, room.max_steps), 0.0)
        else:
            nxt = np.empty(self.num_envs, dtype=np.int64)
            true_reward, truncated = np.zeros(self.num_envs), np.empty(self.num_envs, dtype=bool)
            for r in np.unique(self.room):
                mask, room = self.room == r, self.rooms[r]
                nxt[mask] = room.next_state[self.state[mask], actions[mask]]
                truncated[mask] = self.t[mask] >= room.max_steps
                ended = mask & (nxt < 0)
                true_reward[ended] = self.reward(self.t[ended], room.max_steps)
        terminated = nxt < 0
        self.ret += true_reward
        self.state = np.maximum(nxt, 0)
        done = terminated | truncated
        info: dict[str, Any] = {}
        if done.any():
            info["final_info"] = {"episode": {"r": self.ret.copy(), "l": self.t.copy()}, "_episode": done.copy()}
            self._start(done)
        return self._observe(), true_reward * self.reward_scale, terminated, truncated, info


def make_vector_env(env_id: str, num_envs: int, reward_scale: float = 1.0,
                    **kwargs: Any) -> gym.vector.SyncVectorEnv | RoomVectorEnv:
    """`num_envs` copies of `env_id` whose finished envs reset within the same step: a `RoomVectorEnv` for the
    empty rooms of `WORLDS` (the same numbers, stepped in numpy), else a SyncVectorEnv of `make_env`."""
    if env_id in WORLDS:
        spec = gym.spec(env_id)
        return RoomVectorEnv(num_envs, reward_scale=reward_scale, **{**spec.kwargs, **kwargs})
    return gym.vector.SyncVectorEnv(
        [lambda: make_env(env_id, reward_scale, **kwargs) for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
