"""policy-churn: a learning-rate shock saturates a DQN's tanh trunk; policy churn explodes as a SYMPTOM.

EXPERIMENTAL: the failure is induced cleanly, but the matched fix does not fix it (see the calibration).

Named after policy churn (Schaul et al. 2022: one update flips the greedy action on states outside its
batch) and CHAIN (Tang & Berseth 2024, "Improving Deep RL by Reducing the Chain Effect of Value and Policy
Churn"), which reduces churn and is claimed to let agents train at higher update intensity. The setting is
that question at toy scale; the mechanism we MEASURE is not churn-driven (below).

Setting (everything the task fixes lives in this file):
- World: `stabench/EmptyRandomFlat-6x6-v0`, registered here: MiniGrid's empty 6x6 room (4 x 4 floor, goal
  bottom-right) with a uniformly random start cell and direction, a 40-step timeout, the grids family's flat
  147-dim view / 10 and 3 actions. 60 states (15 cells x 4 directions) but only 48 distinct observations.
- Return: EXACT, not sampled. The world is deterministic, so `StateTable` enumerates every state once by
  driving the real MiniGrid env (observation, and successor under each action) and the row's `return` is the
  greedy policy's expected return from the uniform random start, 1 - 0.9 t / 40 per start (0 if it loops),
  computed from one forward pass per iteration. Optimum 0.89875 (the normalization ceiling; floor 0).
- Held-out states: the same 60 enumerated states. They are never trained on as such, but a world this small
  has no state the replay never holds, so `policy_churn` is the per-update greedy-action change over the
  whole state space; `policy_churn_out` counts only the states whose observation is NOT in that update's TD
  batch (Schaul et al.'s out-of-batch churn): 0.02-0.04 lower before onset, the same after.
- Trainer: DQN (baselines/dqn.py), 8 envs x 16 steps per iteration, then 32 updates on uniform replay
  samples of 64 (replay ratio 16 samples per transition), Adam lr 1e-3, gamma 0.95, MSE TD loss against a
  target network hard-copied every 64 updates, epsilon 1 -> 0.05 over the first 2,000 env steps, updates
  from env step 256, replay of 10,000. Q-network: 147-64-64-3 MLP with tanh (PyTorch default init).
- Injection: from the first injected iteration on, Adam's learning rate x 15 (knob `lr_mult`; `updates_mult`
  multiplies the updates per iteration, `ramp` spreads the lr rise over that many iterations, `onset` moves
  the first injected iteration). The control keeps lr 1e-3.
- Ground truth: the run fails if the mean exact greedy return over the last third of the run (iterations
  40-59 at quick) is below 0.5. Matched fix: CHAIN, value-churn reduction with the automatic coefficient
  (baselines/stabilizers/chain.py, beta 0.05 as in the paper's DDQN). Named non-fix: global gradient-norm
  clipping at 0.5. Detector: per-update policy churn above 0.35.
- Every row: `return`, `policy_churn`, `policy_churn_out`, `value_churn` (mean |dQ| per update on the held-out
  states), `policy_churn_iter`, `frozen_units` (share of hidden units whose activation varies by less than
  0.01 over all 60 states: saturated tanh), `q_state_spread` (std of Q over states), `greedy_mode_share` and
  `greedy_action_entropy` (the greedy policy's action marginal over states), `entropy` (mean entropy of
  softmax(Q) on the states), per-layer gradient norms, `td_loss`, `train_return` (epsilon-greedy episodes).

Mechanism, as measured (quick tier, seeds 0-9, first injected iteration = 20):
- The shock: the first injected iteration (32 updates at lr 1.5e-2) moves Q by 0.40-0.62 per update on the
  held-out states (value churn; healthy 0.012-0.024), the TD loss jumps 41-65x (to 0.19-0.48) and the
  gradient norm 1.4-26x. By its end 66-100% of the trunk's tanh units are saturated on every state (0%
  before, 0% in every control), and they stay so to the end of the run (66-100%).
- The collapse that follows: Q no longer depends on the state (std over states 0.08-0.15 before onset,
  0.000-0.017 after; controls 0.07-0.09), the greedy policy takes the same action on 89-100% of states
  (controls 45-50%) and the exact return falls to 0.03-0.29 (tail means) while the controls reach 0.77-0.85.
- Churn is a symptom, not the cause: per-update policy churn goes from 0.09-0.16 to 0.45-0.55 (out-of-batch
  0.06-0.13 to 0.45-0.54), because with Q flat over states the argmax flips on near-ties. Reducing churn
  does not help: CHAIN leaves post-onset churn at 0.42-0.55 and the return at 0.06-0.39 (10/10 fail),
  though in the healthy regime it does what it claims: control churn 0.04-0.06 vs 0.07-0.09 and control
  return 0.82-0.88 vs 0.77-0.85 (seeds 0-9). Its pull toward the previous update's Q cannot undo a step
  that has already saturated the trunk.
- The cause is the size of the step, and saturation is what decides: with the same lr reached over 8
  iterations (`ramp=8`) no unit saturates at onset and 4/5 baseline seeds keep 0.62-0.71 and never saturate,
  while the fifth saturates 73% of its units later in the ramp and fails (0.24). CHAIN is WORSE under the
  ramp (3/5 fail: 0.23 0.69 0.25 0.20 0.82), and its three failures saturate 77-81% of their units. Over the
  15 ramped runs (three methods), failure and saturation coincide exactly: every failed run saturated 73-81%
  of its units, every surviving run at most 1%. Raising the replay ratio 4x at the same lr (`updates_mult=4,
  lr_mult=1`) IMPROVES the return (0.84-0.87) and lowers churn (0.06-0.08).
- Gradient clipping at 0.5 caps the onset spike: 0-20% of units saturate, churn after onset 0.20-0.58, tails
  0.22-0.75 (7/10 fail, 5 of them partly: 0.41-0.48): better than CHAIN, still not a fix; its two worst runs
  are the two most saturated (20% -> 0.24, 15% -> 0.22). Under the ramp it fails 0/5 and never saturates.
- The entropy door of the other grid tasks does not read here: `entropy` (softmax of Q at temperature 1) is
  1.05-1.10 nats (ln 3 = 1.099) in every run, failed or not, because Q's action gaps are a few hundredths;
  the collapse shows in `greedy_action_entropy` (controls 1.00-1.08, failed baselines 0.00-0.25) and
  `greedy_mode_share` instead.
- With ReLU instead of tanh (exploration, same harness): the shock kills first-layer units instead (e.g.
  seed 1: never active on any state 62% -> 97% in the first injected iteration); at lr x 10 CHAIN then helped
  (fails: baseline 6/10, CHAIN 1/10, clipping 2/10, control 0/10) but not at x 13 (seeds 0-4: 3/5, 3/5, 4/5)
  nor x 20 (seeds 0-2: 2/3, 3/3, 3/3): a knife-edge, so the calibrated task uses tanh, where the failure is
  robust.

Calibration (quick: 60 iterations, onset 20; tail-mean exact return, last 20 iterations; failed = below 0.5):
| method | injected, seeds 0-4 | failed 0-4 (0-9) | control failed | policy churn pre -> post onset, seeds 0-4 |
|---|---|---|---|---|
| baseline | 0.27 0.13 0.29 0.05 0.03 | 5/5 (10/10) | 0/5 (0/10) | 0.09-0.16 -> 0.46-0.52 |
| chain | 0.32 0.09 0.19 0.22 0.26 | 5/5 (10/10) | 0/5 (0/10) | 0.07-0.12 -> 0.42-0.55 |
| grad-clip | 0.48 0.24 0.41 0.22 0.75 | 4/5 (7/10) | 0/5 (0/10) | 0.09-0.16 -> 0.20-0.58 |
Controls (seeds 0-4): baseline and grad-clip 0.83 0.77 0.77 0.84 0.81, chain 0.82 0.88 0.86 0.88 0.86.
Detector (policy churn > 0.35): fires on the first injected iteration in all 10 baseline runs, never before
onset nor on a control (largest healthy value 0.28, largest control value 0.17, over 30 runs per variant).
Full (120 iterations, onset 40), seeds 0-2 only: baseline 0.03 0.03 0.04 (3/3 fail), chain 0.07 0.23 0.06
(3/3), grad-clip 0.44 0.54 0.43 (2/3); controls 0.79-0.89, 0/3 each. One thread: 6-8 s per (method, seed)
at quick (healthy phase plus both branches; CHAIN the slowest), 13-15 s at full.

Suite 0.3.0: `chain` and `grad-clip` moved to `critics.py` and `clipping.py` unchanged; re-run at the quick
tier (5 seeds): baseline 5/5 fail, chain 5/5, grad-clip 3/5, and `frozen-at-onset` 0/5 (normalized 0.71): the
policy at onset already earns most of the post-onset return, so this task does not yet demand learning after
onset; verdict unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from minigrid.envs import EmptyEnv
from stabench.baselines.dqn import DQN, DQNConfig, QNetwork, q_spec, softmax_entropy
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.grids import N_ACTIONS, OBS_SCALE, flatten_minigrid, make_vector_env

SIZE = 6
MAX_STEPS = 40
ENV_ID = f"stabench/EmptyRandomFlat-{SIZE}x{SIZE}-v0"
OBS_DIM = 147  # 7 x 7 x 3 egocentric view, flattened
WIDTH, DEPTH, ACTIVATION = 64, 2, "tanh"
FROZEN_RANGE = 0.01  # a hidden unit is frozen if its activation varies less than this over all states

DQN_CONFIG = DQNConfig(num_envs=8, num_steps=16, updates_per_iteration=32, batch_size=64, ref_batch_size=64,
                       buffer_size=10_000, learning_rate=1e-3, adam_eps=1e-8, gamma=0.95, tau=1.0, target_every=64,
                       start_e=1.0, end_e=0.05, exploration_steps=2_000, learning_starts=256)


def make_empty_random_flat(size: int = SIZE, max_steps: int = MAX_STEPS, render_mode: str | None = None) -> gym.Env:
    """MiniGrid's empty room, start cell and direction uniformly random, goal bottom-right, flat interface."""
    return flatten_minigrid(EmptyEnv(size=size, agent_start_pos=None, max_steps=max_steps, render_mode=render_mode))



# ---- the world, enumerated: exact greedy return and the held-out states ----------------------------------------
@dataclass(frozen=True)
class StateTable:
    """Every (cell, direction) state of the world: its observation and its deterministic transitions.

    Built once by driving the real MiniGrid env from each state with each action. `next_state[s, a]` is the
    successor's index, -1 where the action reaches the goal and ends the episode.
    """

    states: tuple[tuple[int, int, int], ...]  # (x, y, direction) of each state
    obs: torch.Tensor  # S x obs_dim, exactly the observations the env emits (aliased states share one)
    next_state: np.ndarray  # S x A
    max_steps: int

    def greedy_steps(self, greedy: np.ndarray) -> np.ndarray:
        """Steps to the goal from every state under a deterministic policy (inf where it loops).

        World and policy are deterministic, so a policy that revisits a state loops forever.
        """
        n = len(greedy)
        steps = np.full(n, math.inf)
        known = np.zeros(n, dtype=bool)
        for s0 in range(n):
            path, s, on_path = [], s0, set()
            while s >= 0 and not known[s] and s not in on_path:
                on_path.add(s)
                path.append(s)
                s = int(self.next_state[s, greedy[s]])
            tail = 0.0 if s < 0 else (steps[s] if known[s] else math.inf)  # goal, a known state, or a loop
            for k, p in enumerate(reversed(path)):
                steps[p], known[p] = tail + k + 1, True
        return steps

    def greedy_return(self, greedy: np.ndarray) -> float:
        """Exact expected return of the policy from the uniform random start: 1 - 0.9 t / T, 0 if t > T."""
        t = self.greedy_steps(greedy)
        return float(np.where(t <= self.max_steps, 1.0 - 0.9 * t / self.max_steps, 0.0).mean())


_TABLES: dict[tuple[int, int], StateTable] = {}


def state_table(size: int = SIZE, max_steps: int = MAX_STEPS) -> StateTable:
    """The world's state table (built on first use, then cached in the process)."""
    key = (size, max_steps)
    if key not in _TABLES:
        env = EmptyEnv(size=size, agent_start_pos=None, max_steps=max_steps)
        env.reset(seed=0)
        states = [(x, y, d) for y in range(1, size - 1) for x in range(1, size - 1) for d in range(4)
                  if env.grid.get(x, y) is None]  # every start MiniGrid can draw: empty cells x 4 directions
        index = {s: i for i, s in enumerate(states)}
        obs, nxt = [], np.zeros((len(states), N_ACTIONS), dtype=np.int64)
        for i, (x, y, d) in enumerate(states):
            env.agent_pos, env.agent_dir, env.step_count = (x, y), d, 0
            image = np.asarray(env.gen_obs()["image"], dtype=np.float32)
            obs.append((image.reshape(-1) / OBS_SCALE).astype(np.float32))  # as tasks.grids.FlatObs does
            for a in range(N_ACTIONS):
                env.agent_pos, env.agent_dir, env.step_count = (x, y), d, 0
                _, _, terminated, _, _ = env.step(a)
                after = (int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir))
                nxt[i, a] = -1 if terminated else index[after]
        _TABLES[key] = StateTable(tuple(states), torch.as_tensor(np.stack(obs)), nxt, max_steps)
    return _TABLES[key]


def optimal_return(size: int = SIZE, max_steps: int = MAX_STEPS) -> float:
    """Expected return of the optimal policy from the uniform random start (shortest paths on the table)."""
    table = state_table(size, max_steps)
    dist = np.full(len(table.obs), math.inf)
    for _ in range(len(table.obs) + 1):  # Bellman-Ford on unit-cost edges
        succ = np.where(table.next_state < 0, 0.0, dist[np.maximum(table.next_state, 0)])
        dist = np.minimum(dist, (1.0 + succ).min(1))
    return float(np.where(dist <= max_steps, 1.0 - 0.9 * dist / max_steps, 0.0).mean())


def frozen_units(activations: list[torch.Tensor]) -> float:
    """Share of hidden units whose activation varies by less than FROZEN_RANGE over the held-out states
    (a dead ReLU unit, or a tanh unit saturated at the same sign on every state)."""
    if not activations:
        return math.nan
    spread = torch.cat([a.max(0).values - a.min(0).values for a in activations])
    return float((spread < FROZEN_RANGE).float().mean())


# ---- knobs ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """What the injection does at onset, and when. `PolicyChurn(**knobs)`; the defaults are the calibrated task."""

    lr_mult: float = 15.0  # learning rate x this from the first injected iteration on
    updates_mult: int = 1  # gradient updates per iteration (the replay ratio) x this
    ramp: int = 0  # iterations over which the lr multiplier rises geometrically to lr_mult (0: all at once)
    onset: int | None = None  # first injected iteration at the quick and full tiers (None: the tier's own)

    def check(self, shortest_run: int) -> None:
        def integer(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        if not (isinstance(self.lr_mult, (int, float, np.number)) and not isinstance(self.lr_mult, bool)
                and math.isfinite(self.lr_mult) and self.lr_mult > 0):
            raise StabenchError(f"policy-churn: lr_mult must be a finite number > 0, got {self.lr_mult!r}")
        if not (integer(self.updates_mult) and self.updates_mult >= 1):
            raise StabenchError(f"policy-churn: updates_mult must be an integer >= 1, got {self.updates_mult!r}")
        if not (integer(self.ramp) and self.ramp >= 0):
            raise StabenchError(f"policy-churn: ramp must be an integer >= 0, got {self.ramp!r}")
        if self.onset is not None and not (integer(self.onset) and 0 < self.onset < shortest_run):
            raise StabenchError(
                f"policy-churn: onset must be an integer in 1..{shortest_run - 1} (inside every quick and full run), "
                f"got {self.onset!r}"
            )


# ---- one run ----------------------------------------------------------------------------------------------------
class PolicyChurnRun:
    """One seed: the vector env, the Q-network, its target, Adam, the replay buffer and the generator all live
    in `self.trainer`, so `copy.deepcopy` branches everything."""

    def __init__(self, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...], knobs: Knobs) -> None:
        self.cfg = replace(DQN_CONFIG, seed=seed)
        self.table = state_table()
        envs = make_vector_env(ENV_ID, self.cfg.num_envs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = QNetwork(q_spec(OBS_DIM, N_ACTIONS, WIDTH, DEPTH, ACTIVATION))
            self.trainer = DQN(envs, model, self.cfg, stabilizer, heldout_obs=self.table.obs)
        self.diagnostics, self.knobs = diagnostics, knobs
        self.injected_iterations = 0

    def lr_multiplier(self) -> float:
        k, ramp = self.injected_iterations, self.knobs.ramp
        return self.knobs.lr_mult ** (min(k, ramp) / ramp) if ramp else self.knobs.lr_mult

    def step(self, injected: bool) -> dict[str, float]:
        if injected:
            self.injected_iterations += 1
            self.trainer.set_intensity(self.cfg.updates_per_iteration * self.knobs.updates_mult,
                                       self.cfg.learning_rate * self.lr_multiplier())
        state = self.trainer.iterate()
        q = state.extras["heldout_q"][-1]
        greedy = q.argmax(-1).numpy()
        share = np.bincount(greedy, minlength=N_ACTIONS) / len(greedy)  # the greedy policy's action marginal
        row = {
            "step": float(state.extras["global_step"]),
            "return": self.table.greedy_return(greedy),
            "train_return": state.extras["episode_return"],
            "entropy": float(softmax_entropy(q).mean()),
            "td_loss": state.losses["td_loss"],
            "q_mean": state.losses["q_mean"],
            "epsilon": state.extras["epsilon"],
            "learning_rate": self.trainer.optimizer.param_groups[0]["lr"],
            "greedy_mode_share": float(share.max()),
            "greedy_action_entropy": float(-(share[share > 0] * np.log(share[share > 0])).sum()),
            "q_state_spread": float(q.std(0).mean()),
            "frozen_units": frozen_units(state.extras.get("activations", [])),
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return {k: float(v) for k, v in row.items()}


class PolicyChurn(Task):
    """See the module docstring."""

    id = "policy-churn"
    family = "grids"
    version = "1"
    trainer = "dqn"
    budgets = {
        "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=60, onset=20, seeds=5),
        "full": Budget(iterations=120, onset=40, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=0.5, fails_when="below", reduce="tail_mean", tail=1 / 3)
    matched_fix = "chain"
    methods = ("baseline", "chain", "grad-clip")
    detector = DetectorSpec(metric="policy_churn", threshold=0.35)
    diagnostics = ("churn", "grad_norms")
    return_floor = 0.0
    return_ceiling = 0.89875  # optimal_return(): the exact optimum from the uniform random start (tested)
    experimental = True

    knobs_type = Knobs

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> PolicyChurnRun:
        self.budget(tier)  # validates the tier
        return PolicyChurnRun(seed, stabilizer, self.diagnostics, self.knobs)

    def grid(self, name: str, tier: str) -> list[dict[str, Any]]:
        """`stabench run --grid intensity`: learning-rate x replay-ratio multipliers at onset, one trial per cell."""
        if name != "intensity":
            return super().grid(name, tier)
        return [{"lr_mult": lr, "updates_mult": u} for lr, u in product((1.0, 3.0, 10.0, 15.0, 30.0), (1, 4))]
