"""Shared helpers for the MiniGrid ("grids") family of tasks.

A grid task sees MiniGrid's 7x7x3 egocentric view as one flat float vector (`ImgObsWrapper`, flattened,
divided by 10 so every entry lies in [0, 1]; 147 inputs) and acts with the first three MiniGrid actions
(turn left, turn right, forward), which are all an empty room needs.

The family's one engine: every grid world is deterministic, so `grid_table` reads a `GridTable` off MiniGrid
itself (each state's view, each action's successor, which goal a step ends on), `TableWorldFlat` steps one
world from it and `TableVectorEnv` steps many in numpy, bit for bit as MiniGrid behind the family's wrappers
would. A world says only how its MiniGrid env is built and placed in a state, how an episode starts and which
goal pays (`EmptyRoomFlat` here; the pocket room of policy-churn, the two-goal room of primacy-bias).

`environments` are the flattened rooms the PPO grid tasks train on, registered under the `stabench/` namespace by
this module (read from its source: `stabench.suite.registry.discover("world")`), for example
`gymnasium.make("stabench/EmptyFlat-5x5-v0")`: MiniGrid's empty room stepped from a table of MiniGrid's own views and
transitions (`EmptyRoomFlat`, equal to `flatten_minigrid(EmptyEnv(...))` bit for bit; entry point `make_empty_flat`).
`make_vector_env` builds the training vector env, which resets a finished env within the same step and
records true episode statistics *below* the reward scale, so a task can multiply the reward the learner sees
(`vec.set_attr("reward_scale", 1000.0)`) while `info["final_info"]["episode"]["r"]` keeps reporting the true,
unscaled return: for the empty rooms a `RoomVectorEnv`, which steps every env in numpy, else a `SyncVectorEnv`
of `make_env` (a `RewardScale` wrapper over `RecordEpisodeStatistics`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
import torch
from gymnasium.utils import seeding
from minigrid.core.world_object import Goal
from minigrid.envs import EmptyEnv
from minigrid.minigrid_env import MiniGridEnv
from minigrid.wrappers import ImgObsWrapper

N_ACTIONS = 3  # turn left, turn right, move forward
OBS_SCALE = 10.0  # largest MiniGrid object index is 10, so obs / 10 lies in [0, 1]
# The empty rooms the PPO grid tasks train on (flattened MiniGrid rooms, `make_empty_flat`), registered at `import
# stabench`: gymnasium id -> (entry point in this module, kwargs), a literal.
environments = {"stabench/EmptyFlat-5x5-v0": ("make_empty_flat", {"size": 5})}


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


Key = tuple[int, ...]  # a state: (x, y, heading), after what an episode keeps fixed (a drawn cue: (cue, x, y, heading))


def place_at(env: MiniGridEnv, key: Key) -> None:
    """Put a reset MiniGrid env into state `key`: the agent's cell and heading, no step taken yet."""
    env.agent_pos, env.agent_dir, env.step_count = (key[-3], key[-2]), key[-1], 0


def free_states(env: MiniGridEnv) -> list[Key]:
    """Every (x, y, heading) on an empty interior cell of a reset MiniGrid env, row by row: the states of a room."""
    return [(x, y, d) for y in range(1, env.height - 1) for x in range(1, env.width - 1) for d in range(4)
            if env.grid.get(x, y) is None]


def place_agent(rng: np.random.Generator, size: int, free: Callable[[int, int], bool]) -> tuple[int, int, int]:
    """A start drawn with MiniGrid's own calls in MiniGrid's order (`place_agent`: a cell of the whole grid, x then
    y, again until `free` accepts it; then a heading), so a seeded table world starts where MiniGrid starts."""
    while True:
        x, y = int(rng.integers(0, size)), int(rng.integers(0, size))
        if free(x, y):
            return x, y, int(rng.integers(0, 4))


def uniform_start(rng: np.random.Generator, size: int, table: GridTable) -> Key:
    """A start on any of the table's cells with any heading, drawn as MiniGrid's `place_agent` draws it."""
    return place_agent(rng, size, lambda x, y: (x, y, 0) in table.index)


@dataclass(frozen=True)
class GridTable:
    """Every state of a deterministic MiniGrid world: its flat view and what each action does, read off MiniGrid.

    Built by `grid_table`, which drives the real env from each state with each action. `next_state[s, a]` is the
    successor's index, -1 where the step ends the episode on a goal cell that is not one of `states` (`goal_obs[s]`
    is the view then, heading kept; zeros where no action of s does); `reach[s, a]` is the goal (index into
    `goals`) the step ends the episode on, -1 for none; `goal[s]` the goal state s stands on, -1 for none.
    `start` is the state MiniGrid's seeded reset puts the agent in (-1 where the world's start keys differ).
    """

    states: tuple[Key, ...]  # state index -> key
    obs: torch.Tensor  # S x D float32, exactly the views the env emits (aliased states share one)
    next_state: np.ndarray  # S x A
    reach: np.ndarray  # S x A
    goal: np.ndarray  # S
    goal_obs: np.ndarray  # S x D
    goals: tuple[tuple[int, int], ...]  # the goal cells
    start: int
    max_steps: int
    index: dict[Key, int]  # key -> state index

    def steps_to_goal(self) -> np.ndarray:
        """Fewest steps from every state to a goal (inf where none is reachable): Bellman-Ford on unit costs."""
        dist = np.full(len(self.obs), math.inf)
        for _ in range(len(self.obs) + 1):
            after = np.where(self.reach >= 0, 0.0, dist[np.maximum(self.next_state, 0)])
            dist = np.minimum(dist, (1.0 + after).min(1))
        return dist

    def optimal_return(self) -> float:
        """Best return from `start`: 1 - 0.9 t / T for the shortest path's t steps (0 if it exceeds T)."""
        t = self.steps_to_goal()[self.start]
        return float(1.0 - 0.9 * t / self.max_steps) if t <= self.max_steps else 0.0

    def evaluate(self, logits: torch.Tensor) -> tuple[float, float]:
        """Exact expected return of the stochastic policy softmax(logits[s]) from `start`, and its entropy
        averaged over the states it visits (occupancy-weighted), by forward dynamic programming over time.
        For worlds whose goals are not states (`next_state` -1 on arrival)."""
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

    def greedy_steps(self, greedy: np.ndarray, next_state: np.ndarray | None = None) -> np.ndarray:
        """Steps to the goal from every state under a deterministic policy (inf where it loops), in a world whose
        goals are not states; `next_state` replaces the table's (a task that relabels the actions passes its own).

        World and policy are deterministic, so a policy that revisits a state loops forever.
        """
        nxt = self.next_state if next_state is None else next_state
        n = len(greedy)
        steps = np.full(n, math.inf)
        known = np.zeros(n, dtype=bool)
        for s0 in range(n):
            path, s, on_path = [], s0, set()
            while s >= 0 and not known[s] and s not in on_path:
                on_path.add(s)
                path.append(s)
                s = int(nxt[s, greedy[s]])
            tail = 0.0 if s < 0 else (steps[s] if known[s] else math.inf)  # goal, a known state, or a loop
            for k, p in enumerate(reversed(path)):
                steps[p], known[p] = tail + k + 1, True
        return steps

    def greedy_return(self, greedy: np.ndarray, next_state: np.ndarray | None = None) -> float:
        """Exact expected return of a deterministic policy from a uniformly random state: 1 - 0.9 t / T, 0 if t > T."""
        t = self.greedy_steps(greedy, next_state)
        return float(np.where(t <= self.max_steps, 1.0 - 0.9 * t / self.max_steps, 0.0).mean())


def grid_table(env: MiniGridEnv, states: Sequence[Key], max_steps: int,
               place: Callable[[MiniGridEnv, Key], None] = place_at) -> GridTable:
    """The table of a reset MiniGrid env over `states`, each reached by `place(env, key)`: the view there and the
    outcome of each action, as `env.step` makes it. A step may leave the states only by ending on a goal."""
    goals = tuple((x, y) for y in range(env.height) for x in range(env.width) if isinstance(env.grid.get(x, y), Goal))
    states = tuple(tuple(int(v) for v in key) for key in states)
    index = {key: i for i, key in enumerate(states)}
    start = index.get((int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir)), -1)
    dim = int(np.prod(env.observation_space["image"].shape))
    obs, nxt = [], np.zeros((len(states), N_ACTIONS), dtype=np.int64)
    reach = np.full((len(states), N_ACTIONS), -1, dtype=np.int64)
    goal_obs = np.zeros((len(states), dim), dtype=np.float32)
    for i, key in enumerate(states):
        place(env, key)
        obs.append(flat_view(env.gen_obs()["image"]))
        for a in range(N_ACTIONS):
            place(env, key)
            view, _, terminated, _, _ = env.step(a)
            cell = (int(env.agent_pos[0]), int(env.agent_pos[1]))
            nxt[i, a] = index.get((*key[:-3], *cell, int(env.agent_dir)), -1)
            if terminated:
                reach[i, a] = goals.index(cell)
                if nxt[i, a] < 0:
                    goal_obs[i] = flat_view(view["image"])
            elif nxt[i, a] < 0:
                raise ValueError(f"action {a} from {key} leads to a state outside the table")
    goal = np.array([goals.index(key[-3:-1]) if key[-3:-1] in goals else -1 for key in states], dtype=np.int64)
    return GridTable(states, torch.as_tensor(np.stack(obs)), nxt, reach, goal, goal_obs, goals, start, max_steps,
                     index)


_TABLES: dict[tuple[int, int, tuple[int, int]], GridTable] = {}


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


def empty_room(size: int, max_steps: int, goal: tuple[int, int], render_mode: str | None = None) -> EmptyEnv:
    """MiniGrid's empty room, reset with seed 0, its goal moved to `goal`."""
    env = EmptyEnv(size=size, max_steps=max_steps, render_mode=render_mode)
    env.reset(seed=0)
    if tuple(goal) != default_goal(size):
        place_goal(env, goal)
    return env


def room_table(size: int, max_steps: int, goal: tuple[int, int] | None = None) -> GridTable:
    """The table of MiniGrid's empty `size` x `size` room, built once per process. `goal` moves the goal to
    another interior cell (opt-in; None keeps MiniGrid's bottom-right corner)."""
    goal = default_goal(size) if goal is None else (int(goal[0]), int(goal[1]))
    key = (size, max_steps, goal)
    if key not in _TABLES:
        env = empty_room(size, max_steps, goal)
        _TABLES[key] = grid_table(env, free_states(env), max_steps)
    return _TABLES[key]


class TableWorldFlat(gym.Env):
    """A MiniGrid world behind the family's flat interface, stepped from its `GridTable`.

    Observations, rewards (MiniGrid's 1 - 0.9 * (t / T) on reaching a goal that `pays`, else 0), termination and
    truncation are those of the wrapped MiniGrid env bit for bit (each world's test steps both side by side):
    MiniGrid re-renders its egocentric view and passes it through three wrappers on every step. A world says how
    an episode starts (`draw_start`: None, the table's fixed start), which goal pays (`pays`) and, for rendering,
    which MiniGrid env draws it (`painter`, placed in each state by `place`, as the table was built).
    """

    metadata = {"render_modes": ["human", "rgb_array"], "render_fps": 10}
    place = staticmethod(place_at)

    def __init__(self, table: GridTable, size: int, render_mode: str | None = None) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r} is not one of {self.metadata['render_modes']}")
        self.size, self.render_mode = int(size), render_mode
        self.use_table(table)
        self.observation_space = gym.spaces.Box(0.0, 1.0, shape=self._obs.shape[1:], dtype=np.float32)
        self.action_space = gym.spaces.Discrete(N_ACTIONS)
        self.state, self.step_count = table.start, 0
        self.last: Key = table.states[max(table.start, 0)]  # the agent's state (on a goal once reached)
        self._painter: MiniGridEnv | None = None

    def use_table(self, table: GridTable) -> None:
        self.table, self.max_steps, self._obs = table, table.max_steps, table.obs.numpy()

    @property
    def agent_pos(self) -> tuple[int, int]:
        """The agent's cell, as MiniGrid's attribute (the goal's once reached)."""
        return self.last[-3:-1]

    @property
    def agent_dir(self) -> int:
        """The agent's heading, as MiniGrid's attribute (0 right, 1 down, 2 left, 3 up)."""
        return self.last[-1]

    def draw_start(self, rng: np.random.Generator) -> Key | None:
        """The key of an episode's first state, drawn from `rng`; None: the table's fixed start."""
        return None

    def pays(self, goal: int) -> bool:
        """Whether reaching `goal` (index into the table's goals) earns MiniGrid's reward; else it ends with 0."""
        return True

    def painter(self) -> MiniGridEnv:
        """The reset MiniGrid env that renders this world."""
        raise NotImplementedError

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        key = self.draw_start(self.np_random)
        self.state, self.step_count = self.table.start if key is None else self.table.index[key], 0
        self.last = self.table.states[self.state]
        if self.render_mode == "human":
            self.render()
        return self._obs[self.state].copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        a = int(action)
        if not 0 <= a < N_ACTIONS:
            raise ValueError(f"action {action!r} is not one of the room's {N_ACTIONS} actions")
        if self.state < 0 or self.table.goal[self.state] >= 0:
            raise RuntimeError("the agent stands on a goal: call reset() before stepping again")
        self.step_count += 1
        nxt, goal = int(self.table.next_state[self.state, a]), int(self.table.reach[self.state, a])
        truncated = self.step_count >= self.max_steps  # as MiniGrid: also on a goal reached at the last step
        if nxt < 0:  # onto a goal cell that is not a state: MiniGrid keeps the heading
            obs = self.table.goal_obs[self.state].copy()
            self.last = (*self.last[:-3], *self.table.goals[goal], self.last[-1])
        else:
            obs, self.last = self._obs[nxt].copy(), self.table.states[nxt]
        self.state = nxt
        reward = 1 - 0.9 * (self.step_count / self.max_steps) if goal >= 0 and self.pays(goal) else 0.0
        if self.render_mode == "human":
            self.render()
        return obs, reward, goal >= 0, truncated, {}

    def render(self) -> np.ndarray | None:
        if self.render_mode is None:
            return None
        if self._painter is None:
            self._painter = self.painter()
        self.place(self._painter, self.last)
        self._painter.step_count = self.step_count
        return self._painter.render()

    def close(self) -> None:
        if self._painter is not None:
            self._painter.close()
            self._painter = None


class EmptyRoomFlat(TableWorldFlat):
    """MiniGrid's empty room behind the family's flat interface, stepped from its table: equal to
    `flatten_minigrid(EmptyEnv(...))` bit for bit (a test steps both side by side).

    Opt-in: `goal` puts the goal on another interior cell, and `change_room(goal, max_steps)` switches the
    room (goal cell and timeout) from the next `reset` on, so an episode under way ends in the room it began.
    """

    def __init__(self, size: int = 5, max_steps: int | None = None, render_mode: str | None = None,
                 goal: tuple[int, int] | None = None) -> None:
        max_steps = 4 * size * size if max_steps is None else int(max_steps)  # MiniGrid's default
        self.goal = default_goal(size) if goal is None else (int(goal[0]), int(goal[1]))
        super().__init__(room_table(size, max_steps, self.goal), size, render_mode)
        self._next_room: tuple[tuple[int, int], int] | None = None

    def change_room(self, goal: tuple[int, int], max_steps: int | None = None) -> None:
        """From the next `reset` on, the goal stands on `goal` and episodes time out after `max_steps`."""
        goal = (int(goal[0]), int(goal[1]))
        max_steps = self.max_steps if max_steps is None else int(max_steps)
        room_table(self.size, max_steps, goal)  # validates the goal cell now
        self._next_room = (goal, max_steps)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        if self._next_room is not None:
            (self.goal, max_steps), self._next_room = self._next_room, None
            self.use_table(room_table(self.size, max_steps, self.goal))
            self.close()  # the painter draws the room it was built for
        return super().reset(seed=seed, options=options)

    def painter(self) -> MiniGridEnv:
        return empty_room(self.size, self.max_steps, self.goal, self.render_mode)


class RandomStartRoomFlat(EmptyRoomFlat):
    """MiniGrid's empty room with a uniformly random start cell and heading (`EmptyEnv(agent_start_pos=None)`),
    stepped from its table like `EmptyRoomFlat`: the starts are MiniGrid's own draws (`place_agent`), so a seeded
    run starts where MiniGrid starts, episode after episode; the goal stays in its corner (`change_room` is not
    offered).
    """

    def __init__(self, size: int = 5, max_steps: int | None = None, render_mode: str | None = None) -> None:
        super().__init__(size=size, max_steps=max_steps, render_mode=render_mode)

    def change_room(self, goal: tuple[int, int], max_steps: int | None = None) -> None:
        raise NotImplementedError("the random-start room keeps MiniGrid's goal")

    def draw_start(self, rng: np.random.Generator) -> Key:
        return uniform_start(rng, self.size, self.table)


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


class TableVectorEnv(gym.vector.VectorEnv):
    """`num_envs` table worlds stepped together in numpy, as a same-step-autoreset SyncVectorEnv of
    `make_env` over the single world steps them (each world's test steps both side by side).

    A finished env starts its next episode within the same step; `info["final_info"]["episode"]["r"/"l"]` under
    the mask `info["final_info"]["_episode"]` reports the true, unscaled return, and the reward the learner sees is
    multiplied by `reward_scale` (`set_attr("reward_scale", x)`). Starts are the table's fixed one, or drawn by
    `draw_start` from each env's own generator, seeded as the SyncVectorEnv seeds its sub-envs (`seed + i`);
    `paying_goal` says which goal pays in each env (None: every goal). Envs may be in different rooms (`rooms`,
    `room`): a room switch takes effect at each env's next reset (`switch_room`). `info["final_obs"][i]` is a
    finished env's last view (DQN stores it as the transition's next observation). The synchronous wrapper stack
    cost 20 us per env step in Python; this steps all envs in a handful of array operations. Not offered:
    rendering.
    """

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int, table: GridTable, reward_scale: float = 1.0) -> None:
        self.num_envs, self.reward_scale = num_envs, float(reward_scale)
        self.rooms = [table]
        self._obs = [table.obs.numpy()]
        self.room = np.zeros(num_envs, dtype=np.int64)  # each env's room (index into `rooms`)
        self.next_room = np.full(num_envs, -1, dtype=np.int64)  # the room from the env's next reset on
        self.single_observation_space = gym.spaces.Box(0.0, 1.0, shape=tuple(table.obs.shape[1:]), dtype=np.float32)
        self.single_action_space = gym.spaces.Discrete(N_ACTIONS)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.state = np.full(num_envs, max(table.start, 0), dtype=np.int64)
        self.t = np.zeros(num_envs, dtype=np.int64)
        self.ret = np.zeros(num_envs)
        self.rngs: list[np.random.Generator | None] = [None] * num_envs
        self.single = 0  # the room every env is in, -1 while they are in different rooms

    @staticmethod
    def reward(t: np.ndarray, max_steps: int) -> np.ndarray:
        """MiniGrid's success reward after `t` steps: 1 - 0.9 * (t / T), in MiniGrid's order of operations."""
        return 1 - 0.9 * (t / max_steps)

    def draw_start(self, rng: np.random.Generator) -> Key | None:
        """The key of an episode's first state, drawn from the env's generator; None: the room's fixed start."""
        return None

    def paying_goal(self) -> np.ndarray | None:
        """The goal that pays in each env (index into the table's goals); None: every goal pays."""
        return None

    def switch_room(self, table: GridTable) -> int:
        """From each env's next reset on, the world is `table` (tables are built once per process); its index."""
        known = [i for i, room in enumerate(self.rooms) if room is table]
        if not known:
            self.rooms.append(table)
            self._obs.append(table.obs.numpy())
        self.next_room[:] = known[0] if known else len(self.rooms) - 1
        return int(self.next_room[0])

    def set_attr(self, name: str, values: Any) -> None:
        """`SyncVectorEnv.set_attr` for the wrapper's one attribute (`reward_scale`), one value for every env."""
        if name != "reward_scale" or isinstance(values, (list, tuple)):
            raise AttributeError(f"{type(self).__name__} sets one reward_scale for every env, not {name!r}={values!r}")
        self.reward_scale = float(values)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """`SyncVectorEnv.get_attr` for `max_steps` (of each env's current room) and `reward_scale`."""
        if name == "max_steps":
            return tuple(self.rooms[r].max_steps for r in self.room)
        if name == "reward_scale":
            return (self.reward_scale,) * self.num_envs
        raise AttributeError(f"{type(self).__name__} does not report {name!r}")

    def _start(self, envs: np.ndarray) -> None:
        """Begin a new episode in `envs` (a boolean mask), in the room each is switching to, if any."""
        switch = envs & (self.next_room >= 0)
        self.room[switch], self.next_room[switch] = self.next_room[switch], -1
        for r in np.unique(self.room[envs]):
            self.state[envs & (self.room == r)] = self.rooms[r].start
        for env in np.flatnonzero(envs):  # a world that draws its starts: each env from its own generator
            if self.rngs[env] is None:
                self.rngs[env] = seeding.np_random()[0]
            key = self.draw_start(self.rngs[env])
            if key is None:  # a fixed start, set above
                break
            self.state[env] = self.rooms[self.room[env]].index[key]
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
        if seed is not None:
            self.rngs = [seeding.np_random(seed + env)[0] for env in range(self.num_envs)]
        self._start(np.ones(self.num_envs, dtype=bool))
        return self._observe(), {}

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        actions = np.asarray(actions, dtype=np.int64)
        if actions.shape != (self.num_envs,) or (actions.view(np.uint64) >= N_ACTIONS).any():  # negatives too
            raise ValueError(f"expected {self.num_envs} actions in 0..{N_ACTIONS - 1}, got {actions!r}")
        self.t += 1
        pays = self.paying_goal()
        if self.single >= 0:  # every env in one room: no per-room masks
            room = self.rooms[self.single]
            nxt, reach = room.next_state[self.state, actions], room.reach[self.state, actions]
            truncated = self.t >= room.max_steps  # as MiniGrid: also on a goal reached at the last step
            paid = reach >= 0 if pays is None else (reach >= 0) & (reach == pays)
            true_reward = np.where(paid, self.reward(self.t, room.max_steps), 0.0)
        else:
            nxt, reach = np.empty(self.num_envs, dtype=np.int64), np.empty(self.num_envs, dtype=np.int64)
            true_reward, truncated = np.zeros(self.num_envs), np.empty(self.num_envs, dtype=bool)
            for r in np.unique(self.room):
                mask, room = self.room == r, self.rooms[r]
                nxt[mask] = room.next_state[self.state[mask], actions[mask]]
                reach[mask] = room.reach[self.state[mask], actions[mask]]
                truncated[mask] = self.t[mask] >= room.max_steps
                ended = mask & (reach >= 0) & (True if pays is None else reach == pays)
                true_reward[ended] = self.reward(self.t[ended], room.max_steps)
        terminated = reach >= 0
        self.ret += true_reward
        before, self.state = self.state, np.maximum(nxt, 0)
        done = terminated | truncated
        info: dict[str, Any] = {}
        if done.any():
            final = self._observe()
            for i in np.flatnonzero(nxt < 0):  # onto a goal that is not a state: the view MiniGrid returned then
                final[i] = self.rooms[self.room[i]].goal_obs[before[i]]
            info["final_obs"], info["_final_obs"] = final, done.copy()
            info["final_info"] = {"episode": {"r": self.ret.copy(), "l": self.t.copy()}, "_episode": done.copy()}
            self._start(done)
        return self._observe(), true_reward * self.reward_scale, terminated, truncated, info


class RoomVectorEnv(TableVectorEnv):
    """`num_envs` empty rooms (`EmptyRoomFlat`) stepped together in numpy.

    `call("change_room", goal, max_steps)`, `set_attr("reward_scale", x)` and `get_attr` do what they do on the
    SyncVectorEnv: each env switches room at its next reset, so an episode under way ends in the room it began.
    """

    def __init__(self, num_envs: int, size: int = 5, max_steps: int | None = None,
                 goal: tuple[int, int] | None = None, reward_scale: float = 1.0) -> None:
        max_steps = 4 * size * size if max_steps is None else int(max_steps)  # MiniGrid's default
        goal = default_goal(size) if goal is None else (int(goal[0]), int(goal[1]))
        super().__init__(num_envs, room_table(size, max_steps, goal), reward_scale)
        self.size = size
        self.goals = [goal]  # each room's goal cell

    def change_room(self, goal: tuple[int, int], max_steps: int | None = None) -> None:
        """From each env's next reset on, the goal stands on `goal` and episodes time out after `max_steps`."""
        goal = (int(goal[0]), int(goal[1]))
        max_steps = self.rooms[0].max_steps if max_steps is None else int(max_steps)
        if self.switch_room(room_table(self.size, max_steps, goal)) == len(self.goals):  # validates the goal now
            self.goals.append(goal)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """`SyncVectorEnv.call` for the room's one method (`change_room`): applies to every env."""
        if name != "change_room":
            raise AttributeError(f"RoomVectorEnv offers call('change_room', ...) only, not {name!r}")
        self.change_room(*args, **kwargs)
        return (None,) * self.num_envs

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """`SyncVectorEnv.get_attr` for `goal`, `max_steps` (of each env's current room) and `reward_scale`."""
        if name == "goal":
            return tuple(self.goals[r] for r in self.room)
        return super().get_attr(name)


def make_vector_env(env_id: str, num_envs: int, reward_scale: float = 1.0,
                    **kwargs: Any) -> gym.vector.SyncVectorEnv | RoomVectorEnv:
    """`num_envs` copies of `env_id` whose finished envs reset within the same step: a `RoomVectorEnv` for the
    empty rooms (`make_empty_flat`: the same numbers, stepped in numpy), else a SyncVectorEnv of `make_env`."""
    if gym.spec(env_id).entry_point == f"{__name__}:make_empty_flat":
        spec = gym.spec(env_id)
        return RoomVectorEnv(num_envs, reward_scale=reward_scale, **{**spec.kwargs, **kwargs})
    return gym.vector.SyncVectorEnv(
        [lambda: make_env(env_id, reward_scale, **kwargs) for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
