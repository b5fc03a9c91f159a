"""primacy-bias: after onset the walls' colour says which goal pays, and every 40 updates the colours swap
meaning; PPO trained on a place rule first keeps a near-deterministic policy head that cannot follow.

What it measures (named for the mechanism measured, after Nikishin et al. 2022, "The primacy bias in deep RL":
a network fitted to early experience under-uses later evidence; their remedy resets the last layers). Version 2
of this task was named representation-collapse after Saheb et al. (2026): the trained trunk does compress the
cue, but the measured block was the certainty of the policy head, so the task was renamed and its matched fix is
now the head-level one; the isotropic Gaussian regularizer stays a registered method (`isotropic-gaussian`).

Setting (everything the task fixes lives in this file; chosen on seeds 0-9 with prototypes, below):
- World `stabench/TwoGoals-5x5-v0`: a 3x3 room (5x5 MiniGrid with walls) with two identical green goal
  squares in its top corners. Each episode starts on a uniformly random free cell (7) facing a uniformly
  random direction, and draws the walls' colour, the CUE, uniformly from grey and red (in every view: the
  flat inputs of 5-11 wall cells read 0.5 or 0.0). 56 start states. Egocentric 5x5 view, flattened and / 10
  (75 inputs), three actions, 10-step timeout. Stepping on the paying goal ends the episode with MiniGrid's
  1 - 0.9 t / 10, on the other with 0. All 72 states (cue x cell x direction) are enumerated, so the exact
  expected return of the current policy from the start distribution is computed every update by backward
  induction (`WorldTable`); optimum 0.6657 under every rule. The runs step their 8 worlds together in numpy
  (`TwoGoalsVectorEnv`, tested equal to gymnasium's SyncVectorEnv of `make_two_goals`, bit for bit).
- Rules. Healthy phase (updates 0-39): the LEFT goal pays whatever the walls' colour (the place rule; the cue is
  irrelevant). From onset, in BOTH branches: grey walls -> left goal pays, red -> right (the cue rule); every
  `switch_every` = 40 updates the cue's meaning swaps (quick: periods 40-79 and 80-119, the second a reversal;
  full: four periods). The healthy optimum (always left) earns exactly 0.5 of the optimum under either meaning;
  uniform-random 0.136.
- Trainer: PPO (baselines/ppo.py, unchanged), 8 envs x 32 steps, 8 epochs x 2 minibatches, Adam lr 2.5e-3 eps
  1e-5, gamma 0.99, lambda 0.95, clip 0.2, entropy 0.01, value coefficient 0.5, no gradient clipping.
- Network: Linear(75, 64)-ReLU-Linear(64, 64)-ReLU-Linear(64, 16), the last layer LINEAR: z (16 units) is
  the representation both heads read; policy and value heads as CleanRL initializes them.
- Injected branch: the healthy-phase network keeps training through the switches. Control ("fresh"): at onset
  and at each swap a new network and Adam, so it faces each rule with nothing carried over. Knob `reset`
  ("head", "heads", "trunk", "all"; injected branch) re-initializes one part in place (and Adam) at onset and
  each swap: the causal checks below.
- Ground truth: `tracking`, reported on the last update of each period, is the mean exact return over that
  period's last 10 updates, over the optimum; a run fails if any post-onset period tracks below 0.75, half-way
  between the healthy optimum's 0.5 and the optimum, which fresh networks pass in 40 updates and a frozen or
  non-learning policy cannot.
- Return: the row `return` is the exact expected return of the current policy (not the rollout's episodes,
  which are `episode_return`). Normalized return: `return_floor` = 0.3127 is what the policy FROZEN AT ONSET
  earns after onset (the injected `frozen-at-onset` runs' post-onset mean `return`, seeds 0-9; the healthy
  optimum would earn 0.333); `return_ceiling` = 0.4350 is the fresh control's post-onset mean `return`
  (baseline's control branch, seeds 0-9; measured once, fixed). The mean runs over all post-onset updates, so it
  rewards following each switch early, not only at a period's end.
- Matched fix: `head-reset` (baselines/stabilizers/resets.py: when the smoothed reward rate falls 30% below its
  best, re-initialize the policy head, restart Adam, and skip the policy step on that iteration's batch); named
  non-fix: `entropy-bonus`.
- Detector: `confident_shortfall` above 0.44, chosen on seeds 100-109 only: above every control row there (at
  most 0.39) and every pre-onset row but one seed's (its healthy phase collapsed at update 36, see below),
  below the baseline's median over its first five injected updates (0.50).
- Diagnostics, every row: `state_entropy` (mean policy entropy over the start states) and `logit_range` (the
  head's certainty), `cue_gap` (how far z moves when only the cue changes, over the spread of z across the start
  states; 0 = the cue is discarded), `effective_rank` and `sv/00`..`sv/15` of z on the 56 start states
  (`spectrum`), `entropy` (rollout), `exact_return`, `exact_return_other_goal` (the swapped meaning),
  `exact_return_left` (the place rule), `tracking_error`, `paying`, `cued`, `since_switch`, `networks`,
  `feature_norm`; `confident_shortfall` = (1 - episode return / optimum) x (1 - entropy / log 3), the detector.

Mechanism, as measured (quick tier, seeds 0-9; the numbers, per seed set, are in results/calibration.md, section
primacy-bias and its design notes):
- At onset the healthy network's head is near-deterministic over the start states (low entropy, a wide logit
  range, against a fresh network's near-uniform head), and its cue gap is a fraction of a fresh network's (the
  trunk has compressed the cue). It keeps going left, then partly learns the cue in the first period and cannot
  reverse it in the second: at the end of the reversal it is still near-certain and tracks around what the
  always-left policy earns, while fresh networks track the cue in both periods.
- Causal checks (knob `reset` at each switch, injected branch, prototypes on seeds 0-9): resetting only the
  policy head fails some seeds, only the trunk (heads kept) fewer, no reset every seed. The certain head is the
  dominant block; a trunk reset also makes the logits near-uniform, so it removes both factors.
- The detected reset (`head-reset`) fires one or two updates after onset and after the swap on every seed. Two
  of its design steps were measured, not assumed: resetting the head and its Adam moments only, or the head
  and every Adam moment, both fail most seeds, because the reset head is trained on the iteration's batch,
  collected by the certain policy, and re-learns the cue-blind place rule within a few updates; skipping the
  policy step on that batch (advantages zeroed; the value head still learns) is what lets the fresh head explore.
- At this learning rate the healthy phase itself is not always stable: on one of the seeds 0-9 and 100-109
  PPO's return collapses before onset; the run is kept as it is.
- Settings tried on seeds 0-9 (each with the baseline's injected and control failures in the design notes):
  version 2 (lr 1.5e-3, one 80-update period) on the current code, whose controls sat on the bar; lr 2.5e-3 with
  one period; 4 epochs x 1 minibatch at lr 3e-3; onset 60; entropy 0 or 0.003; a 40-update reversal after an
  80-update period, 160 updates; periods of 50, under which `head-reset`'s own control failed often; chosen,
  periods of 40, 120 updates as version 2. Seeds 100-109 were run once on the chosen settings before the last
  alternative (periods of 50) was tried on seeds 0-9, so seeds 200-209, run once after the settings were
  frozen, are the never-used check.

Calibration numbers per seed set, commands and verdicts: results/calibration.md (runs in
results/calibration/primacy-bias/). The quick tier runs this task on 5 seeds; calibration and the matrix run 10.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
import torch
from minigrid.core.grid import Grid
from minigrid.core.mission import MissionSpace
from minigrid.core.world_object import Goal
from minigrid.minigrid_env import MiniGridEnv
from stabench.baselines.models import ActorCritic, he_linear
from stabench.baselines.ppo import PPO, PPOConfig
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, StabenchError, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import DiagnosedRun, categorical_entropy
from stabench.suite.figures import mean_ci, need, onset_line, save
from stabench.tasks.worlds.grids import (
    N_ACTIONS,
    GridTable,
    TableVectorEnv,
    TableWorldFlat,
    flatten_minigrid,
    grid_table,
    place_agent,
    place_at,
)
from stabench.tasks.worlds.scaffold import Trailing
from torch import nn

if TYPE_CHECKING:
    import pandas as pd

# --- The world ------------------------------------------------------------------------------------------
SIZE = 5  # 5x5 grid with walls: a 3x3 room
CELLS = tuple((x, y) for y in range(1, SIZE - 1) for x in range(1, SIZE - 1))
GOALS = ((1, 1), (3, 1))  # the two identical goal squares: the room's top corners; GOALS[0] pays before onset
MAX_STEPS = 10
VIEW = 5  # egocentric view 5x5x3
OBS_DIM = VIEW * VIEW * 3
ENV_ID = "stabench/TwoGoals-5x5-v0"
CUE_COLOURS = ("grey", "red")  # the walls' colour, drawn per episode: the cue


class TwoGoalsEnv(MiniGridEnv):
    """A 3x3 room with two identical goal squares in its top corners and walls of a random colour (the cue).

    Each episode starts on a uniformly random free cell facing a uniformly random direction and draws the
    walls' colour `cue` uniformly from `CUE_COLOURS` (the walls are in every view). Stepping onto either goal
    ends the episode: the paying one with MiniGrid's 1 - 0.9 t / max_steps, the other with 0. The paying goal
    is `GOALS[paying]` while `cued` is false (the cue is then irrelevant) and `GOALS[cue ^ paying]` while it
    is true (the walls' colour says which goal pays). The task sets both attributes on a vector env.
    """

    def __init__(self, size: int = SIZE, max_steps: int = MAX_STEPS, agent_view_size: int = VIEW, paying: int = 0,
                 render_mode: str | None = None) -> None:
        self.paying = int(paying)
        self.cued = False
        self.cue = 0
        self._obs_cache: dict[tuple[int, int, int, int], np.ndarray] = {}
        super().__init__(mission_space=MissionSpace(mission_func=self._gen_mission), grid_size=size,
                         max_steps=max_steps, see_through_walls=True, agent_view_size=agent_view_size,
                         render_mode=render_mode)

    @staticmethod
    def _gen_mission() -> str:
        return "get to the goal that pays"

    def _build(self, width: int, height: int, cue: int) -> None:
        self.cue = int(cue)
        self.grid = Grid(width, height)
        colour = CUE_COLOURS[self.cue]
        self.grid.wall_rect(0, 0, width, height)
        for x in range(width):
            for y in range(height):
                cell = self.grid.get(x, y)
                if cell is not None and cell.type == "wall":
                    cell.color = colour
        for x, y in GOALS:
            self.put_obj(Goal(), x, y)

    def _gen_grid(self, width: int, height: int) -> None:
        self._build(width, height, self._rand_int(0, len(CUE_COLOURS)))
        self.place_agent()  # uniform over the free cells, uniform direction
        self.mission = self._gen_mission()

    def paying_goal(self) -> int:
        return (self.cue ^ self.paying) if self.cued else self.paying

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        if terminated and (int(self.agent_pos[0]), int(self.agent_pos[1])) != GOALS[self.paying_goal()]:
            reward = 0.0
        return obs, float(reward), terminated, truncated, info

    def gen_obs(self) -> dict[str, Any]:
        """MiniGrid's observation, memoized on (position, direction, cue): nothing else changes."""
        key = (int(self.agent_pos[0]), int(self.agent_pos[1]), int(self.agent_dir), self.cue)
        image = self._obs_cache.get(key)
        if image is None:
            image = super().gen_obs()["image"]
            self._obs_cache[key] = image
        return {"image": image.copy(), "direction": self.agent_dir, "mission": self.mission}


def draw_start(rng: np.random.Generator, size: int) -> tuple[int, int, int, int]:
    """An episode's (cue, x, y, direction), drawn as `TwoGoalsEnv._gen_grid` draws them: the cue, then
    `place_agent` (cells until a free one off the goals, then a direction)."""
    cue = int(rng.integers(0, len(CUE_COLOURS)))
    return (cue, *place_agent(rng, size, lambda x, y: 0 < x < size - 1 and 0 < y < size - 1 and (x, y) not in GOALS))


def make_two_goals(size: int = SIZE, max_steps: int = MAX_STEPS, render_mode: str | None = None) -> gym.Env:
    """The world with the grids family's interface: flat 75-dim view / 10, three actions. Stepped from its table
    (`TwoGoalsFlat`, equal to `minigrid_two_goals` bit for bit, the random cue and start included)."""
    return TwoGoalsFlat(size=size, max_steps=max_steps, render_mode=render_mode)


def minigrid_two_goals(size: int = SIZE, max_steps: int = MAX_STEPS, render_mode: str | None = None) -> gym.Env:
    """The same world as MiniGrid steps it (the reference the table-driven world is tested against)."""
    return flatten_minigrid(TwoGoalsEnv(size=size, max_steps=max_steps, render_mode=render_mode))


def place_cue(env: TwoGoalsEnv, key: tuple[int, ...]) -> None:
    """Put the world into state (cue, x, y, direction): the walls in the cue's colour, the agent on its cell."""
    env._build(env.width, env.height, key[0])
    place_at(env, key)


@functools.cache
def two_goals_table(size: int = SIZE, max_steps: int = MAX_STEPS) -> GridTable:
    """Every (cue, x, y, direction) of the interior, goals included, read off `TwoGoalsEnv` (`grids.grid_table`):
    its view as `FlatObs` writes it and the state after each action; the goals are states (`goal`), reaching one
    ends the episode (`reach`)."""
    env = TwoGoalsEnv(size=size, max_steps=max_steps)
    env.reset(seed=0)
    cells = tuple((x, y) for y in range(1, size - 1) for x in range(1, size - 1))
    states = [(c, x, y, d) for c in range(len(CUE_COLOURS)) for x, y in cells for d in range(4)]
    table = grid_table(env, states, max_steps, place_cue)
    env.close()
    if table.goals != GOALS:
        raise ValueError(f"the room's goals {table.goals} are not {GOALS}")
    return table


class TwoGoalsFlat(TableWorldFlat):
    """`flatten_minigrid(TwoGoalsEnv(...))` stepped from its table, bit for bit.

    `reset` draws the cue and then the start from `np_random` with MiniGrid's calls in MiniGrid's order
    (`draw_start`); a step onto either goal ends the episode, with MiniGrid's 1 - 0.9 t / max_steps on the paying
    one and 0 on the other. `paying` and `cued` are `TwoGoalsEnv`'s (the task sets them on the vector env).
    """

    place = staticmethod(place_cue)

    def __init__(self, size: int = SIZE, max_steps: int = MAX_STEPS, paying: int = 0,
                 render_mode: str | None = None) -> None:
        self.paying, self.cued, self.cue = int(paying), False, 0
        super().__init__(two_goals_table(size, max_steps), size, render_mode)

    def paying_goal(self) -> int:
        return (self.cue ^ self.paying) if self.cued else self.paying

    def pays(self, goal: int) -> bool:
        return goal == self.paying_goal()

    def draw_start(self, rng: np.random.Generator) -> tuple[int, int, int, int]:
        key = draw_start(rng, self.size)
        self.cue = key[0]
        return key

    def painter(self) -> TwoGoalsEnv:
        env = TwoGoalsEnv(size=self.size, max_steps=self.max_steps, render_mode=self.render_mode)
        env.reset(seed=0)
        return env


@dataclass(frozen=True)
class WorldTable:
    """Every state of the world (cue x cell x direction), its observation and its moves.

    `next_state[s, a]` is the state after action a (turns, moves, bumps into walls; the cue never changes
    within an episode); `goal[s]` is the goal the agent stands on (-1: none); `cue[s]` the walls' colour;
    `start[s]` marks the start states (on no goal), uniformly likely. The observation depends on the state only.
    """

    obs: torch.Tensor  # n x OBS_DIM
    next_state: np.ndarray  # n x N_ACTIONS
    goal: np.ndarray  # n
    cue: np.ndarray  # n
    start: np.ndarray  # n, bool
    max_steps: int

    def paying(self, paying: int, cued: bool) -> np.ndarray:
        """The paying goal of every state: `paying`, or `cue ^ paying` under the cued rule."""
        return (self.cue ^ paying) if cued else np.full(len(self.cue), paying)

    def _backup(self, probs: np.ndarray | None, paying: int, cued: bool) -> tuple[float, np.ndarray]:
        v = np.zeros(len(self.goal))
        arrive = self.goal[self.next_state]
        pays = self.paying(paying, cued)[:, None]
        q = np.zeros(self.next_state.shape)
        for t in reversed(range(self.max_steps)):
            reward = 1.0 - 0.9 * (t + 1) / self.max_steps  # MiniGrid's reward on arrival at step t + 1
            q = np.where(arrive == pays, reward, np.where(arrive >= 0, 0.0, v[self.next_state]))
            v = q.max(1) if probs is None else (probs * q).sum(1)
        return float(v[self.start].mean()), q

    def greedy(self, paying: int = 0, cued: bool = False) -> np.ndarray:
        """A deterministic optimal policy (states x actions, one-hot): a shortest path to the paying goal."""
        q = self._backup(None, paying, cued)[1]
        return np.eye(self.next_state.shape[1])[q.argmax(1)]

    def value(self, probs: np.ndarray, paying: int, cued: bool = False) -> float:
        """Exact expected return of a policy (states x actions) from the start distribution, by backward induction."""
        return self._backup(probs, paying, cued)[0]

    def optimum(self, paying: int = 0, cued: bool = False) -> float:
        """Expected return of the best policy (a shortest path to the paying goal)."""
        return self._backup(None, paying, cued)[0]


@functools.cache
def world_table(max_steps: int = MAX_STEPS) -> WorldTable:
    """The world enumerated (`two_goals_table`): every cue, cell and direction, moves as MiniGrid makes them."""
    table = two_goals_table(SIZE, max_steps)
    cue = np.array([key[0] for key in table.states], dtype=np.int64)
    return WorldTable(table.obs, table.next_state, table.goal, cue, table.goal < 0, max_steps)


class TwoGoalsVectorEnv(TableVectorEnv):
    """`num_envs` two-goal rooms stepped together in numpy (`grids.TableVectorEnv`): the same observations,
    rewards, termination, truncation and episode returns as the SyncVectorEnv of wrapped `TwoGoalsFlat` worlds it
    replaces (tests step both side by side), each env drawing its cue and start from its own generator. That
    wrapper stack cost a sixth of a PPO trial on this world.

    `set_attr` and `get_attr` handle `paying` and `cued` as on the SyncVectorEnv (they act from the next step
    on, an episode under way included).
    """

    def __init__(self, num_envs: int, size: int = SIZE, max_steps: int = MAX_STEPS) -> None:
        super().__init__(num_envs, two_goals_table(size, max_steps))
        self.size, self.max_steps = size, int(max_steps)
        self.cue_of = np.array([key[0] for key in self.rooms[0].states], dtype=np.int64)  # each state's cue
        self.paying = np.zeros(num_envs, dtype=np.int64)
        self.cued = np.zeros(num_envs, dtype=bool)

    def draw_start(self, rng: np.random.Generator) -> tuple[int, int, int, int]:
        return draw_start(rng, self.size)

    def paying_goal(self) -> np.ndarray:
        return np.where(self.cued, self.cue_of[self.state] ^ self.paying, self.paying)

    def set_attr(self, name: str, values: Any) -> None:
        """`SyncVectorEnv.set_attr` for `paying` and `cued`: one value for every env, or one per env."""
        if name not in ("paying", "cued"):
            return super().set_attr(name, values)
        target = getattr(self, name)
        target[:] = np.asarray(values if isinstance(values, (list, tuple)) else [values] * self.num_envs)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """`SyncVectorEnv.get_attr` for `paying`, `cued` and `cue` (each env's walls)."""
        if name == "cue":
            return tuple(v.item() for v in self.cue_of[self.state])
        if name in ("paying", "cued"):
            return tuple(v.item() for v in getattr(self, name))
        return super().get_attr(name)


# --- The network ------------------------------------------------------------------------------------------
class FeatureMLP(ActorCritic):
    """`depth - 1` Linear+ReLU layers of `width`, then a LINEAR layer to `features` units (z), then the heads.

    z is the representation both heads read (penultimate features); its spectrum is the task's diagnostic
    and the isotropic regularizer's target (a linear z can be Gaussian; a ReLU output cannot).
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = dict(spec)
        width, depth, feat = spec["width"], spec["depth"], spec["features"]
        dims = [spec["obs_dim"]] + [width] * (depth - 1)
        self.layers = nn.ModuleList(he_linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(width, feat)
        nn.init.orthogonal_(self.out.weight, 1.0)
        nn.init.zeros_(self.out.bias)
        self._heads(feat, spec["n_actions"])

    def hidden(self, obs: torch.Tensor) -> list[torch.Tensor]:
        acts, h = [], obs
        for layer in self.layers:
            h = torch.relu(layer(h))
            acts.append(h)
        acts.append(self.out(h))
        return acts

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        h = obs
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.out(h)


# --- The knobs --------------------------------------------------------------------------------------------
CONTROLS = ("fresh",)
RESETS = ("none", "head", "heads", "trunk", "all")


@dataclass(frozen=True)
class Knobs:
    """What the task fixes; every field is an optional keyword argument of `PrimacyBias`."""

    switch_every: int = 40  # updates between swaps of the cue's meaning after onset (quick: one, full: three)
    control: str = "fresh"  # "fresh": same switches, a new network and optimizer at each
    reset: str = "none"  # causal check, injected branch: re-initialize "head", "heads", "trunk" or "all" at each switch
    tracking_window: int = 10  # the last updates of each period (or of the run) that count as "tracking"
    isotropic_lam: float = 0.0  # > 0: `isotropic-gaussian`'s setting lam on this task (0: the class default, 5)
    width: int = 64
    depth: int = 3  # Linear layers in the trunk, the last one linear (the features)
    features: int = 16
    ppo: PPOConfig = field(default_factory=lambda: PPOConfig(
        num_envs=8, num_steps=32, learning_rate=2.5e-3, adam_eps=1e-5, gamma=0.99, gae_lambda=0.95,
        update_epochs=8, num_minibatches=2, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5))
    fix: str | None = None  # the matched fix: a registered stabilizer name or plugin reference (None: the default)
    onset: int | None = None  # first injected iteration at the quick and full tiers (None: the tier's own)

    def check(self, shortest_run: int) -> None:
        """Raise StabenchError, with one line naming the knob (the onset is checked by `Task.__init__`)."""
        if self.fix is not None:
            from stabench.suite import registry

            if not (self.fix in registry.names("stabilizer") or registry.is_reference(self.fix)) \
                    or self.fix == "baseline":
                known = ", ".join(n for n in registry.names("stabilizer") if n != "baseline")
                raise StabenchError(f"unknown fix {self.fix!r}; choose a stabilizer: {known}")
        for name in ("switch_every", "tracking_window", "width", "depth", "features"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StabenchError(f"{name} must be a positive integer, got {value!r}")
        if self.tracking_window > self.switch_every:
            raise StabenchError(f"tracking_window {self.tracking_window} exceeds switch_every {self.switch_every}")
        if self.depth < 2:
            raise StabenchError(f"depth must be at least 2 (a hidden layer and the feature layer), got {self.depth}")
        if self.control not in CONTROLS:
            raise StabenchError(f"unknown control {self.control!r}; choose from {', '.join(CONTROLS)}")
        if self.reset not in RESETS:
            raise StabenchError(f"unknown reset {self.reset!r}; choose from {', '.join(RESETS)}")
        lam = self.isotropic_lam
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not lam >= 0:
            raise StabenchError(f"isotropic_lam must be a number >= 0, got {lam!r}")


def confident_shortfall(normalized_return: float, entropy: float) -> float:
    """(1 - R) x (1 - H / log 3), both clipped to [0, 1]: high when the return is low AND the policy is sure.

    R is the rollout's mean episode return over the optimum, H the rollout's mean policy entropy (nats). A
    fresh or exploring policy with a low return scores low; a confident policy that has stopped earning
    scores near 1. NaN when no episode ended.
    """
    if not math.isfinite(normalized_return):
        return math.nan
    shortfall = 1.0 - min(max(normalized_return, 0.0), 1.0)
    certainty = 1.0 - min(max(entropy / math.log(N_ACTIONS), 0.0), 1.0)
    return shortfall * certainty


def cue_gap(z: torch.Tensor) -> float:
    """How far the features move when only the cue changes: mean |z(s, cue 1) - z(s, cue 0)| over the start
    states, over the mean distance of a start state's features from their mean (0: the cue is discarded)."""
    half = len(z) // 2
    spread = (z - z.mean(0)).norm(dim=1).mean()
    return float((z[half:] - z[:half]).norm(dim=1).mean() / spread.clamp_min(1e-12))


class PrimacyBiasRun(DiagnosedRun):
    """One seed: PPO (envs, network, Adam, sampler) in `self.trainer`, plus the goal schedule."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, knobs: Knobs,
                 diagnostics: tuple[str, ...]) -> None:
        self.budget, self.seed, self.knobs, self.diagnostics = budget, seed, knobs, diagnostics
        if stabilizer.name == "isotropic-gaussian" and knobs.isotropic_lam > 0:
            # the task's weight, set as `isotropic-gaussian@lam=...` sets it: the class default stays for other tasks
            from stabench.suite import registry

            lam = registry.format_value(float(knobs.isotropic_lam))
            stabilizer = registry.make_stabilizer(f"isotropic-gaussian@lam={lam}")
        self.stabilizer = stabilizer
        self.table = world_table()
        self.optimum = self.table.optimum(0)
        cfg = replace(knobs.ppo, seed=seed)
        envs = TwoGoalsVectorEnv(cfg.num_envs)  # the SyncVectorEnv of make_env(ENV_ID), stepped in numpy
        self.spec = {"obs_dim": OBS_DIM, "n_actions": N_ACTIONS, "width": knobs.width, "depth": knobs.depth,
                     "features": knobs.features}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = FeatureMLP(self.spec)
            self.trainer = PPO(envs, model, cfg, stabilizer)  # the stabilizer may wrap or hook the model here
        self.paying, self.cued = 0, False
        self.networks = 1
        self.window = Trailing(knobs.tracking_window)  # this period's exact returns (`tracking` reads its tail)
        self.start = torch.as_tensor(self.table.start)

    def period(self, iteration: int) -> int:
        """Goal period of an iteration: -1 before onset, then 0, 1, ... every `switch_every` updates."""
        if iteration < self.budget.onset:
            return -1
        return (iteration - self.budget.onset) // self.knobs.switch_every

    def new_optimizer(self, model: nn.Module) -> None:
        cfg = self.trainer.cfg
        opt = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, foreach=True)
        self.trainer.optimizer = self.stabilizer.optimizer(opt, model)

    def fresh_network(self, period: int) -> None:
        """The fresh-network control: a new network (through the stabilizer's hooks) and a new Adam."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000 + 7 + period)
            model = self.stabilizer.model(FeatureMLP(self.spec), self.spec)
        self.trainer.model = model
        self.new_optimizer(model)
        self.networks += 1

    def reset_part(self, period: int, part: str) -> None:
        """Causal check: re-initialize one part of the network in place (and Adam) at a switch."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000 + 7 + period)
            fresh = FeatureMLP(self.spec).state_dict()
        prefixes = {"head": ("policy.",), "heads": ("policy.", "value."), "trunk": ("layers.", "out."),
                    "all": ("",)}[part]
        model = self.trainer.model
        state = model.state_dict()
        state.update({k: v for k, v in fresh.items() if k.startswith(prefixes)})
        model.load_state_dict(state)
        self.new_optimizer(model)

    def train(self, injected: bool) -> tuple[dict[str, float], TrainState]:
        it, k = self.trainer.iteration, self.knobs.switch_every
        period = self.period(it)
        cued = period >= 0
        paying = period % 2 if cued else 0
        if (paying, cued) != (self.paying, self.cued):
            self.paying, self.cued = paying, cued
            self.trainer.envs.set_attr("paying", paying)
            self.trainer.envs.set_attr("cued", cued)
            self.window = Trailing(self.knobs.tracking_window)
            if not injected:
                self.fresh_network(period)
            elif self.knobs.reset != "none":
                self.reset_part(period, self.knobs.reset)
        state = self.trainer.iterate()

        model = self.trainer.model
        with torch.no_grad():
            logits, _ = model(self.table.obs)
            z = model.features(self.table.obs[self.start])
        probs = torch.softmax(logits.double(), -1).numpy()
        logits = logits[self.start]
        exact = self.table.value(probs, self.paying, self.cued) / self.optimum
        since = it - self.budget.onset - period * k if period >= 0 else it
        last = min(k, self.budget.iterations - self.budget.onset - period * k)  # this period's length in the run
        if period >= 0:
            self.window.push(exact)
        tracking = self.window.mean() if period >= 0 and since == last - 1 else math.nan
        state.extras["features"] = z
        row: dict[str, float] = {
            "step": float(state.extras["global_step"]),
            "return": exact * self.optimum,  # the exact expected return of the current policy
            "episode_return": state.extras["episode_return"],
            "episodes": float(state.extras["episodes"]),
            "entropy": state.losses["entropy"],
            "state_entropy": float(categorical_entropy(logits).mean()),
            "exact_return": exact,
            "exact_return_other_goal": self.table.value(probs, 1 - self.paying, self.cued) / self.optimum,
            "exact_return_left": self.table.value(probs, 0) / self.optimum,
            "tracking": tracking,
            "tracking_error": 1.0 - exact,
            "confident_shortfall": confident_shortfall(state.extras["episode_return"] / self.optimum,
                                                       state.losses["entropy"]),
            "paying": float(self.paying),
            "cued": float(self.cued),
            "since_switch": float(since),
            "networks": float(self.networks),
            "feature_norm": float(z.norm(dim=1).mean()),
            "cue_gap": cue_gap(z),
            "logit_range": float((logits.max(1).values - logits.min(1).values).mean()),
            "policy_loss": state.losses["policy_loss"],
            "value_loss": state.losses["value_loss"],
            "approx_kl": state.losses["approx_kl"],
        }
        return {key: float(v) for key, v in row.items()}, state


# --- The task ------------------------------------------------------------------------------------------------
def draw_certainty(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """Exact return and the policy's certainty over training: the baseline, the head reset, the fresh control."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = need(table, "primacy-bias", "state_entropy", "exact_return")
    methods = [m for m in ("baseline", "head-reset") if m in set(rows["method"])]
    rows = rows[rows["method"].isin(methods) & ((rows["variant"] == "injected") | (rows["method"] == "baseline"))]
    rows = rows.assign(run=np.where(rows["variant"] == "control", "control (fresh network at each switch)",
                                    rows["method"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, column, label in ((axes[0], "exact_return", "exact return / optimum"),
                              (axes[1], "state_entropy", "policy entropy over the start states (nats)")):
        sns.lineplot(rows, x="iteration", y=column, hue="run", errorbar=mean_ci, ax=ax)
        onset_line(ax, rows)
        ax.set_ylabel(label)
    axes[0].axhline(0.75, color="grey", linewidth=0.8, linestyle=":", label="tracking threshold")
    axes[0].legend(fontsize=8)
    axes[0].set_title("Return (mean, 95% CI over seeds)")
    axes[1].set_title("Certainty of the policy head")
    return save(fig, out, name)


class PrimacyBias(Task):
    """See the module docstring. Knobs (all optional): the fields of `Knobs`, among them `onset` and `fix` (the
    matched fix, a registered stabilizer name or plugin reference)."""

    id = "primacy-bias"
    family = "grids"
    version = "3"
    trainer = "ppo"
    budgets = {
        "smoke": Budget(iterations=6, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=120, onset=40, seeds=5),
        "full": Budget(iterations=200, onset=40, seeds=10),
    }
    ground_truth = GroundTruth(metric="tracking", threshold=0.75, fails_when="below", reduce="any")
    matched_fix = "head-reset"
    methods = ("baseline", "head-reset", "entropy-bonus")
    detector = DetectorSpec(metric="confident_shortfall", threshold=0.44, above=True)  # chosen on seeds 100-109
    diagnostics = ("spectrum",)
    return_floor = 0.3127  # frozen-at-onset's post-onset exact return (injected branch), mean of seeds 0-9
    return_ceiling = 0.4350  # the fresh control's post-onset exact return (baseline's control), mean of seeds 0-9

    knobs_type = Knobs
    environments = {"stabench/TwoGoals-5x5-v0": ("make_two_goals", {"size": 5, "max_steps": 10})}
    figures = (
        Figure("head-certainty", "return and head certainty",
               "primacy-bias: the exact return over the optimum (the tracking threshold dotted) and the policy's "
               "entropy over the start states, injected runs of the baseline and of the head reset against the "
               "baseline's fresh-network control.",
               draw_certainty),
    )
    paper = (
        "On primacy-bias PPO first learns a place rule in a small room with two identical goals: the left one "
        "pays, whatever the colour of the walls. From onset, in both branches, the wall colour decides which goal "
        "pays, and every 40 updates the colours swap meaning; the control meets each rule with a fresh network. "
        "The network kept from the healthy phase ends it with a near-deterministic policy head and cannot follow "
        "the switches. Resetting only the policy head at each switch restores tracking on most seeds, so the "
        "certain head, more than the cue its features compressed, is what blocks learning. The matched fix "
        "detects a switch from the fall of its own reward rate, re-initializes the policy head, restarts Adam "
        "and skips the policy step on the batch the certain policy collected. The figure shows the exact return "
        "and the head's certainty for the baseline, the fix and the control."
    )

    def __init__(self, **knobs: Any) -> None:
        super().__init__(**knobs)
        fix = self.knobs.fix
        if fix is not None:
            self.matched_fix = fix
            self.methods = ("baseline", fix, "entropy-bonus") if fix != "entropy-bonus" else ("baseline", fix)

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> PrimacyBiasRun:
        return PrimacyBiasRun(self.budget(tier), seed, stabilizer, self.knobs, self.diagnostics)
