"""representation-collapse: after onset the paying goal switches every 20 updates; PPO cannot re-learn it.

EXPERIMENTAL. Named after Saheb et al. (2026, "Stable deep RL via isotropic Gaussian representations"):
under moving targets the features collapse onto a few directions and a linear readout can no longer track
the target; their fix keeps the features an isotropic Gaussian. This task induces the moving target in a
world where the policy must read its state. The failure is clean, but the mechanism we MEASURE is a
saturated policy head (entropy collapse), not a collapsed representation, and the matched fix misses the
bar (see the calibration below), hence `experimental = True`.

Setting (everything the task fixes lives in this file):
- World `stabench/TwoGoals-5x5-v0`: a 3x3 room (5x5 MiniGrid with walls) with two identical green goal
  squares in its top corners; each episode starts on a uniformly random free cell (7) facing a uniformly
  random direction (28 start states), so the optimal action depends on the state. Egocentric 5x5 view,
  flattened and / 10 (75 inputs), three actions, 10-step timeout. Stepping on the paying goal ends the
  episode with MiniGrid's 1 - 0.9 t / 10, on the other with 0; which one pays is never observed. All 36
  states (cell x direction) are enumerated, so the exact expected return of the current policy from the
  start distribution is computed every update by backward induction (`WorldTable`); optimum 0.6657.
- Trainer: PPO (baselines/ppo.py), 8 envs x 32 steps, 8 epochs x 2 minibatches, Adam lr 1.5e-3 eps 1e-5,
  gamma 0.99, lambda 0.95, clip 0.2, entropy 0.01, value coefficient 0.5, no gradient clipping.
- Network: Linear(75, 64)-ReLU-Linear(64, 64)-ReLU-Linear(64, 16), the last layer LINEAR: z (16 units) is
  the representation both heads read; policy and value heads as CleanRL initializes them.
- Injection: the left goal pays in the healthy phase (updates 0-39 at quick); from onset the right goal
  pays, and the paying goal flips every 20 updates (periods 40-59 right, 60-79 left, 80-99 right, ...).
- Control: the same switches, but each switch also replaces the network and Adam by fresh ones ("fresh";
  `control="fixed"` keeps the left goal and never switches). The fresh control faces exactly the
  injected run's information problem (find the goal that now pays, within 20 updates, from rewards alone)
  with nothing carried over from the previous goal; what it lacks is whatever a trained network carries.
  It answers the question the task asks (does training on one goal make the next one unlearnable?),
  which a no-switch control cannot. Its cost: it starts every period from a uniform policy, so its
  post-onset mean return is no higher than the failing baseline's (normalized 0.48 vs 0.46): the failure
  is visible in per-period tracking, not in the post-onset mean.
- Ground truth: `tracking`, reported on the last update of each goal period, is the mean over that
  period's last 5 updates of the exact expected return divided by the optimum; a run fails if ANY
  post-onset period tracks below 0.6 (i.e. it did not learn the goal it was given within 20 updates).
- Matched fix: `isotropic-gaussian` (lambda 5); named non-fix: `entropy-bonus` (entropy coefficient x5).
- Diagnostics, every row: `effective_rank` and `sv/00`..`sv/15` (normalized singular values) of z on the
  fixed held-out batch of all 28 start-state observations (`spectrum` diagnostic); `entropy` (rollout)
  and `state_entropy` (mean over the 28 start states); `exact_return` and `exact_return_other_goal` (over
  the optimum); `tracking_error` = 1 - exact_return; `since_switch`, `paying`, `networks`; `feature_norm`,
  `logit_range`; `confident_shortfall` = (1 - return / optimum) x (1 - entropy / log 3), the detector.

Mechanism, as measured (quick tier, seeds 0-4):
- The baseline re-learns only the healthy-phase goal. Per-period tracking (periods right, left, right,
  left): seed 0 .34 .89 .00 .89, seed 1 .09 .94 .47 .91, seed 2 .28 .54 .29 .91, seed 3 .30 .78 .29 .74,
  seed 4 .17 .86 .17 .88. It never learns the right goal (not even the second time), and snaps back to
  the left one within a period. Fresh networks learn every period (.70-.89 in all 20 periods).
- What blocks it is the policy's certainty: the healthy phase ends with the policy nearly deterministic
  (start-state entropy 0.10-0.22 nats of 1.10 in the last 5 healthy updates), and it stays so after the
  switch (0.13-0.19 in the 5 updates after a switch; the fresh control starts at 1.03-1.07). The policy
  walks to the old goal, often learns to avoid it (the exact return toward the old goal falls) and times
  out: it rarely reaches the new one. Causal checks (throwaway, resetting one part at each switch, baseline,
  injected): re-initializing ONLY the 16x3 policy head, keeping the trunk and its features, restores
  tracking (.52-.95 in every period; 1/5 fails, on one period at .52); re-initializing only the trunk,
  keeping the heads (whose logits then start near uniform), also does (1/5); re-initializing only the
  value head does not (4/5). The features are therefore sufficient to learn the new goal: the bottleneck
  is the saturated readout, not the representation.
- Effective rank does not explain it: the baseline's rank is 3.4-4.4 before onset, 3.3-4.0 right after a
  switch, 3.1-4.1 late; fresh control networks collapse to the same range (3.2-4.5 late in a period) and
  still learn every goal; the isotropic fix keeps 6.8-8.7 throughout and still fails 3/5.
- Why the fix helps a little: with lambda 5 it keeps the healthy policy less certain (start-state entropy
  0.32-0.46 before onset, vs 0.10-0.22) and 2/5 seeds then track every period. It also slows learning from
  scratch: its own fresh-network control tracks only .41-.68 (5/5 below 0.6). Lambda sweep (injected
  failures, seeds 0-4): 0.2 -> 5/5, 1 -> 5/5, 5 -> 3/5, 10 -> 4/5 (control 5/5), 25 -> 5/5 (control 5/5).
- The plain entropy guard (x5) raises post-switch entropy (0.24-0.40) and improves later right-goal periods
  (.23-.70 vs .00-.47) but misses the first switch on every seed (5/5 fail). Neither the fix nor the guard
  addresses the measured mechanism directly; resetting the policy head at each switch would.
- Settings tried first: (a) this world at lr 5e-4, 4 epochs, onset 20: fresh networks cannot learn a goal
  within 20 updates (raw tracking 0.16-0.19), so the control fails too; (b) lr 1.5e-3, onset 30: the same
  picture as the calibration, the isotropic fix (lambda 1) no help; (c) a visible-
  target world (red and yellow tiles on random cells; which color pays switches): NO failure, the trained
  network transfers (normalized tracking .82-.89 vs .66-.76 for fresh networks); (d) the recipe's setting
  (fixed start) was not reused because its policy does not need to read the state.

Calibration (quick: 120 updates, onset 40, switches every 20; failed = some period tracks below 0.6):
Worst period's tracking per seed (seeds 0-4), failures, and post-onset normalized return [95% bootstrap CI]:
| method | injected worst period | failed | control worst period | failed | norm. return injected |
|---|---|---|---|---|---|
| baseline | .00 .09 .28 .29 .17 | 5/5 | .76 .70 .76 .74 .75 | 0/5 | 0.46 [0.44, 0.49] |
| isotropic-gaussian | .69 .00 .31 .38 .60 | 3/5 | .41 .52 .49 .53 .49 | 5/5 | 0.47 [0.41, 0.51] |
| entropy-bonus | .44 .10 .23 .29 .00 | 5/5 | .74 .73 .77 .70 .76 | 0/5 | 0.46 [0.43, 0.50] |
All periods, injected: isotropic .72 .79 .69 .77 / .08 .72 .00 .78 / .45 .82 .31 .82 / .39 .86 .38 .85 /
.69 .80 .60 .77; entropy-bonus .44 .73 .70 .78 / .10 .96 .28 .95 / .38 .77 .23 .89 / .29 .90 .56 .84 / .00
.94 .68 .87. Fresh controls' normalized return: 0.48 (baseline), 0.37 (isotropic), 0.47 (entropy-bonus).
Bar: baseline >= 80% (met), control <= 20% (met), fix lowers the failure rate by >= 50 points (40: missed)
or raises normalized return with a CI clearing the baseline's (missed). Detector: `confident_shortfall`
above 0.5 alarms on the first injected update of every baseline run and never before onset or on a
control (max 0.34 there). Cost, one thread: 7-9 CPU-seconds per (method, seed) at quick (healthy phase
plus both branches), about 120 CPU-seconds for the default 15 trials (reproduced through `run_trial`).
Re-run 2026-11-23 after the PPO trainer moved to fused Adam (results/experimental/representation-collapse):
baseline 5/5, control 0/5; isotropic 4/5 (control 5/5); entropy-bonus 5/5; normalized return 0.45 [0.42,
0.49], 0.46 [0.42, 0.50], 0.45 [0.43, 0.48]. The per-seed figures above are the foreach run's.

Suite 0.3.0: the named non-fix `entropy-bonus` is the one entropy bonus of every trainer, 0.05 times the exact
entropy added beside PPO's own 0.01 (0.06 in all; until 0.2.0 it multiplied PPO's term by 5, 0.05 in all).
Re-run at the quick tier (5 seeds, `results/experimental/representation-collapse`): baseline 5/5 fail,
isotropic-gaussian 4/5 (its control 5/5), entropy-bonus 5/5 (normalized 0.46); verdict unchanged.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from minigrid.core.grid import Grid
from minigrid.core.mission import MissionSpace
from minigrid.core.world_object import Goal
from minigrid.minigrid_env import MiniGridEnv
from stabench.baselines.models import ActorCritic, he_linear
from stabench.baselines.ppo import PPO, PPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS, categorical_entropy
from stabench.tasks.grids import N_ACTIONS, OBS_SCALE, flatten_minigrid, make_vector_env
from torch import nn

# --- The world ------------------------------------------------------------------------------------------
SIZE = 5  # 5x5 grid with walls: a 3x3 room
CELLS = tuple((x, y) for y in range(1, SIZE - 1) for x in range(1, SIZE - 1))
GOALS = ((1, 1), (3, 1))  # the two identical goal squares: the room's top corners; GOALS[0] pays before onset
MAX_STEPS = 10
VIEW = 5  # egocentric view 5x5x3
OBS_DIM = VIEW * VIEW * 3
ENV_ID = "stabench/TwoGoals-5x5-v0"
DIR_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))  # MiniGrid: 0 right, 1 down, 2 left, 3 up


class TwoGoalsEnv(MiniGridEnv):
    """A 3x3 room with two identical goal squares in its top corners; only `GOALS[paying]` pays.

    Each episode starts on a uniformly random free cell facing a uniformly random direction, so the policy
    must read its view to know where it is and which way the paying goal lies. Stepping onto either goal
    ends the episode: the paying one with MiniGrid's 1 - 0.9 t / max_steps, the other with 0. Which one
    pays is not observed (the squares look the same); the task flips `paying` (a plain attribute,
    `set_attr("paying", k)` on a vector env) to move the target. The room is not rotationally symmetric
    with the goals in it, so every state has its own view.
    """

    def __init__(self, size: int = SIZE, max_steps: int = MAX_STEPS, agent_view_size: int = VIEW, paying: int = 0,
                 render_mode: str | None = None) -> None:
        self.paying = int(paying)
        self._obs_cache: dict[tuple[int, int, int], np.ndarray] = {}
        super().__init__(mission_space=MissionSpace(mission_func=self._gen_mission), grid_size=size,
                         max_steps=max_steps, see_through_walls=True, agent_view_size=agent_view_size,
                         render_mode=render_mode)

    @staticmethod
    def _gen_mission() -> str:
        return "get to the goal that pays"

    def _gen_grid(self, width: int, height: int) -> None:
        self.grid = Grid(width, height)
        self.grid.wall_rect(0, 0, width, height)
        for x, y in GOALS:
            self.put_obj(Goal(), x, y)
        self.place_agent()  # uniform over the free cells, uniform direction
        self.mission = self._gen_mission()

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        if terminated and (int(self.agent_pos[0]), int(self.agent_pos[1])) != GOALS[self.paying]:
            reward = 0.0
        return obs, float(reward), terminated, truncated, info

    def gen_obs(self) -> dict[str, Any]:
        """MiniGrid's observation, memoized on (position, direction): the grid never changes."""
        key = (int(self.agent_pos[0]), int(self.agent_pos[1]), int(self.agent_dir))
        image = self._obs_cache.get(key)
        if image is None:
            image = super().gen_obs()["image"]
            self._obs_cache[key] = image
        return {"image": image.copy(), "direction": self.agent_dir, "mission": self.mission}


def make_two_goals(size: int = SIZE, max_steps: int = MAX_STEPS, render_mode: str | None = None) -> gym.Env:
    """The world with the grids family's interface: flat 75-dim view / 10, three actions."""
    return flatten_minigrid(TwoGoalsEnv(size=size, max_steps=max_steps, render_mode=render_mode))



@dataclass(frozen=True)
class WorldTable:
    """Every state of the world (cell x direction), its observation and its moves.

    `next_state[s, a]` is the state after action a (turns, moves, bumps into walls); `goal[s]` is the goal
    the agent stands on (-1: none); `start[s]` marks the start states (on no goal), uniformly likely. The
    observation depends on the state only.
    """

    obs: torch.Tensor  # n x OBS_DIM
    next_state: np.ndarray  # n x N_ACTIONS
    goal: np.ndarray  # n
    start: np.ndarray  # n, bool
    max_steps: int

    def _backup(self, probs: np.ndarray | None, paying: int) -> float:
        v = np.zeros(len(self.goal))
        arrive = self.goal[self.next_state]
        for t in reversed(range(self.max_steps)):
            reward = 1.0 - 0.9 * (t + 1) / self.max_steps  # MiniGrid's reward on arrival at step t + 1
            q = np.where(arrive == paying, reward, np.where(arrive >= 0, 0.0, v[self.next_state]))
            v = q.max(1) if probs is None else (probs * q).sum(1)
        return float(v[self.start].mean())

    def value(self, probs: np.ndarray, paying: int) -> float:
        """Exact expected return of a policy (states x actions) from the start distribution, by backward induction."""
        return self._backup(probs, paying)

    def optimum(self, paying: int) -> float:
        """Expected return of the best policy (a shortest path to the paying goal)."""
        return self._backup(None, paying)


@functools.cache
def world_table(max_steps: int = MAX_STEPS) -> WorldTable:
    """Enumerate the world: every cell and direction, moves computed as MiniGrid makes them."""
    env = TwoGoalsEnv(max_steps=max_steps)
    env.reset(seed=0)
    states = [(c, d) for c in CELLS for d in range(4)]
    index = {s: i for i, s in enumerate(states)}
    obs = np.zeros((len(states), OBS_DIM), dtype=np.float32)
    nxt = np.zeros((len(states), N_ACTIONS), dtype=np.int64)
    goal = np.array([GOALS.index(c) if c in GOALS else -1 for c, _ in states], dtype=np.int64)
    for i, ((x, y), d) in enumerate(states):
        env.agent_pos, env.agent_dir = (x, y), d
        obs[i] = env.gen_obs()["image"].reshape(-1) / OBS_SCALE  # as FlatObs writes it
        fx, fy = x + DIR_VEC[d][0], y + DIR_VEC[d][1]
        ahead = (fx, fy) if (fx, fy) in CELLS else (x, y)
        nxt[i] = [index[((x, y), (d - 1) % 4)], index[((x, y), (d + 1) % 4)], index[(ahead, d)]]
    env.close()
    return WorldTable(torch.as_tensor(obs), nxt, goal, goal < 0, max_steps)


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


# --- The setting (the task's knobs) -------------------------------------------------------------------------
CONTROLS = ("fresh", "fixed")


@dataclass(frozen=True)
class Setting:
    switch_every: int = 20  # updates between goal switches after onset
    control: str = "fresh"  # "fresh": same switches, a new network and optimizer at each; "fixed": no switch
    tracking_window: int = 5  # the last updates of each goal period that count as "tracking"
    width: int = 64
    depth: int = 3  # Linear layers in the trunk, the last one linear (the features)
    features: int = 16
    ppo: PPOConfig = field(default_factory=lambda: PPOConfig(
        num_envs=8, num_steps=32, learning_rate=1.5e-3, adam_eps=1e-5, gamma=0.99, gae_lambda=0.95,
        update_epochs=8, num_minibatches=2, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5))


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


class RepresentationCollapseRun:
    """One seed: PPO (envs, network, Adam, sampler) in `self.trainer`, plus the goal schedule."""

    def __init__(self, budget: Budget, seed: int, stabilizer: Stabilizer, setting: Setting,
                 diagnostics: tuple[str, ...]) -> None:
        self.budget, self.seed, self.setting, self.diagnostics = budget, seed, setting, diagnostics
        self.stabilizer = stabilizer
        self.table = world_table()
        self.optimum = self.table.optimum(0)
        cfg = replace(setting.ppo, seed=seed)
        envs = make_vector_env(ENV_ID, cfg.num_envs)
        self.spec = {"obs_dim": OBS_DIM, "n_actions": N_ACTIONS, "width": setting.width, "depth": setting.depth,
                     "features": setting.features}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = FeatureMLP(self.spec)
            self.trainer = PPO(envs, model, cfg, stabilizer)  # the stabilizer may wrap or hook the model here
        self.paying = 0
        self.networks = 1
        self.window: list[float] = []
        self.start = torch.as_tensor(self.table.start)

    def period(self, iteration: int) -> int:
        """Goal period of an iteration: -1 before onset, then 0, 1, ... every `switch_every` updates."""
        if iteration < self.budget.onset:
            return -1
        return (iteration - self.budget.onset) // self.setting.switch_every

    def fresh_network(self, period: int) -> None:
        """The fresh-network control: a new network (through the stabilizer's hooks) and a new Adam."""
        cfg = self.trainer.cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000 + 7 + period)
            model = self.stabilizer.model(FeatureMLP(self.spec), self.spec)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps)
        self.trainer.model = model
        self.trainer.optimizer = self.stabilizer.optimizer(opt, model)
        self.networks += 1

    def step(self, injected: bool) -> dict[str, float]:
        it, k = self.trainer.iteration, self.setting.switch_every
        period = self.period(it)
        switches = period >= 0 and (injected or self.setting.control == "fresh")
        paying = (1 + period) % 2 if switches else 0
        if paying != self.paying:
            self.paying = paying
            self.trainer.envs.set_attr("paying", paying)
            if not injected:
                self.fresh_network(period)
        state = self.trainer.iterate()

        model = self.trainer.model
        with torch.no_grad():
            logits, _ = model(self.table.obs)
            z = model.features(self.table.obs[self.start])
        probs = torch.softmax(logits.double(), -1).numpy()
        logits = logits[self.start]
        exact = self.table.value(probs, self.paying) / self.optimum
        since = it - self.budget.onset - period * k if period >= 0 else it
        if period >= 0 and since >= k - self.setting.tracking_window:
            self.window.append(exact)
        tracking = math.nan
        if period >= 0 and since == k - 1:
            tracking, self.window = float(np.mean(self.window)), []
        state.extras["features"] = z
        row: dict[str, float] = {
            "step": float(state.extras["global_step"]),
            "return": state.extras["episode_return"],
            "episodes": float(state.extras["episodes"]),
            "entropy": state.losses["entropy"],
            "state_entropy": float(categorical_entropy(logits).mean()),
            "exact_return": exact,
            "exact_return_other_goal": self.table.value(probs, 1 - self.paying) / self.optimum,
            "tracking": tracking,
            "tracking_error": 1.0 - exact,
            "confident_shortfall": confident_shortfall(state.extras["episode_return"] / self.optimum,
                                                       state.losses["entropy"]),
            "paying": float(self.paying),
            "since_switch": float(since),
            "networks": float(self.networks),
            "feature_norm": float(z.norm(dim=1).mean()),
            "logit_range": float((logits.max(1).values - logits.min(1).values).mean()),
            "policy_loss": state.losses["policy_loss"],
            "value_loss": state.losses["value_loss"],
            "approx_kl": state.losses["approx_kl"],
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return {key: float(v) for key, v in row.items()}


# --- The task ------------------------------------------------------------------------------------------------
SETTING_KNOBS = tuple(f.name for f in fields(Setting))


class RepresentationCollapse(Task):
    """See the module docstring. Knobs (all optional): `onset` (overrides every tier's onset), `fix` (the
    matched fix, a registered stabilizer name or plugin reference), and the fields of `Setting`."""

    id = "representation-collapse"
    family = "grids"
    version = "1"
    trainer = "ppo"
    budgets = {
        "smoke": Budget(iterations=6, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=120, onset=40, seeds=5),
        "full": Budget(iterations=200, onset=40, seeds=10),
    }
    ground_truth = GroundTruth(metric="tracking", threshold=0.6, fails_when="below", reduce="any")
    matched_fix = "isotropic-gaussian"
    methods = ("baseline", "isotropic-gaussian", "entropy-bonus")
    detector = DetectorSpec(metric="confident_shortfall", threshold=0.5, above=True)
    diagnostics = ("spectrum",)
    return_floor = 0.0
    return_ceiling = 0.6657142857142858  # exact optimum from a uniform start, `world_table().optimum(0)`
    experimental = True  # the matched fix misses the calibration bar (see the module docstring)

    def __init__(self, onset: int | None = None, fix: str | None = None, **knobs: Any) -> None:
        unknown = sorted(set(knobs) - set(SETTING_KNOBS))
        if unknown:
            raise StabenchError(f"unknown knob(s) {', '.join(unknown)} for {self.id}; "
                                f"known: onset, fix, {', '.join(SETTING_KNOBS)}")
        if onset is not None:
            if isinstance(onset, bool) or not isinstance(onset, int) or onset < 1:
                raise StabenchError(f"onset must be a positive integer, got {onset!r}")
            horizon = max(b.iterations for b in self.budgets.values())
            if onset >= horizon:
                raise StabenchError(f"onset {onset} lies past every tier's horizon (at most {horizon} iterations)")
        if fix is not None:
            from stabench.suite import registry

            if not (fix in registry.names("stabilizer") or registry.is_reference(fix)) or fix == "baseline":
                known = ", ".join(n for n in registry.names("stabilizer") if n != "baseline")
                raise StabenchError(f"unknown fix {fix!r}; choose a stabilizer: {known}")
            self.matched_fix = fix
            self.methods = ("baseline", fix, "entropy-bonus") if fix != "entropy-bonus" else ("baseline", fix)
        setting = replace(Setting(), **knobs)
        for name in ("switch_every", "tracking_window", "width", "depth", "features"):
            value = getattr(setting, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StabenchError(f"{name} must be a positive integer, got {value!r}")
        if setting.tracking_window > setting.switch_every:
            raise StabenchError(
                f"tracking_window {setting.tracking_window} exceeds switch_every {setting.switch_every}")
        if setting.depth < 2:
            raise StabenchError(f"depth must be at least 2 (a hidden layer and the feature layer), got {setting.depth}")
        if setting.control not in CONTROLS:
            raise StabenchError(f"unknown control {setting.control!r}; choose from {', '.join(CONTROLS)}")
        self.onset, self.setting = onset, setting

    def budget(self, tier: str) -> Budget:
        """The tier's budget with the `onset` knob applied (an onset outside the run is a StabenchError)."""
        b = super().budget(tier)
        return b if self.onset is None else Budget(b.iterations, self.onset, b.seeds, b.report_every)

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> RepresentationCollapseRun:
        return RepresentationCollapseRun(self.budget(tier), seed, stabilizer, self.setting, self.diagnostics)
