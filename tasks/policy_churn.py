"""policy-churn: update intensity raised at a rule change (target synced every update, 2x replay ratio, 4x lr).

EXPERIMENTAL: misses the bar by one reference criterion on the calibration seeds:
`no-update` scores 0.105 normalized on seeds 0-9 (bar <= 0.1; 0.057 on seeds 100-109); everything else meets
it on both seed sets (calibration below), and a quick trial takes 9-29 s on the shared machine (aim ~10 s).

Named after policy churn (Schaul et al. 2022: one update flips the greedy action on states outside its
batch) and CHAIN (Tang & Berseth 2024, "Improving Deep RL by Reducing the Chain Effect of Value and Policy
Churn"), which reduces churn and is claimed to let agents train at higher update intensity. Version 2 asks
that question: the injection raises the update intensity (and with it the churn) exactly when the learner
must relearn, and CHAIN is the matched fix.

Setting (everything the task fixes lives in this file):
- World: `stabench/EmptyRandomFlat-6x6-v0`, registered here: MiniGrid's empty 6x6 room (4 x 4 floor, goal
  bottom-right) with a uniformly random start cell and direction, a 40-step timeout, the grids family's flat
  147-dim view / 10 and 3 actions. 60 states (15 cells x 4 directions) but only 48 distinct observations.
- The new rule at onset (BOTH branches, `shift=True`): from the onset iteration on, the learner's action a
  executes MiniGrid action ROTATION[a] = (1, 2, 0)[a] (left -> right, right -> forward, forward -> left), the
  replay buffer (transitions of the old rule) is emptied, learning restarts once 256 new transitions are in,
  and epsilon restarts at 1.0 and falls to 0.05 over 2,000 env steps. Same world, same optimum, relabeled
  controls: the policy of the old rule loops (the old optimal policy earns < 0.15 under the new one,
  tested), so every post-onset point of return has to be learned again.
- Return: EXACT, not sampled. The world is deterministic, so `StateTable` enumerates every state once by
  driving the real MiniGrid env (observation, and successor under each action) and the row's `return` is the
  greedy policy's expected return from the uniform random start, 1 - 0.9 t / 40 per start (0 if it loops),
  under the rule in force (after onset, the table's columns rotated), from one forward pass per iteration.
  Optimum 0.89875 under either rule.
- Held-out states: the same 60 enumerated states; `policy_churn` is the per-update greedy-action change over
  the whole state space, `policy_churn_out` counts only the states whose observation is NOT in that update's
  TD batch (Schaul et al.'s out-of-batch churn), `value_churn` the mean |dQ| per update on them.
- Trainer: DQN (baselines/dqn.py, unchanged; the task subclasses it only to restart epsilon), 8 envs x 16
  steps per iteration, then 32 updates on uniform replay samples of 64 (replay ratio 16), Adam lr 1e-3,
  gamma 0.95, MSE TD loss against a target network hard-copied every 16 updates, epsilon 1 -> 0.05 over the
  first 2,000 env steps, updates from env step 256, replay of 10,000. Q-network: 147-64-64-3 MLP with ReLU
  (PyTorch default init).
- Injection (injected branch, from onset on): the update intensity rises on three axes at once, the ones
  CHAIN's paper scales: the target network is synced after EVERY update (`target_every=1`: moving targets),
  64 updates per iteration (`updates_mult=2`: replay ratio 32) and Adam's lr 4e-3 (`lr_mult=4`). The control
  keeps 32 updates, lr 1e-3 and the sync every 16 updates.
- Ground truth: the run fails if the mean exact greedy return over the last third of the run (iterations
  40-59 at quick) is below 0.6. Matched fix: CHAIN, value-churn reduction with the automatic coefficient
  (baselines/stabilizers/critics.py, beta 0.05 as in the paper's DDQN; unchanged). Named non-fix: global
  gradient-norm clipping at 0.5. Detector: value churn per update above 0.02 (chosen on seeds 100-109 only: there the
  largest value before onset is 0.0131 and on any control 0.0139, while every injected baseline exceeds 0.029;
  it fires on the first updating iteration after onset, 21, in all 10; never on CHAIN's injected runs. On
  seeds 0-9 it fires at 21-22 in all 10 baselines, largest pre-onset 0.0122, control 0.016). The detector
  rows of the two committed runs were computed online under version 1's spec (policy_churn > 0.35).
- Normalization: floor 0.0 = the policy frozen at onset (`frozen-at-onset` earns exactly 0.0000 post-onset
  on every seed 0-9 in both branches: under the rotated controls every frozen greedy policy loops);
  ceiling 0.5604 = the baseline control's mean post-onset return over seeds 0-9 (the control relearns from
  0 to tail means 0.61-0.80; its post-onset mean includes the relearning). The optimum 0.89875 is not used
  as the ceiling because a control that relearns from scratch in 40 iterations reaches 0.62 of it.

Mechanism, as measured (quick tier, seeds 0-9, onset 20; means over seeds at the named iterations):
- Churn rises with the injection: in the first iterations that update after onset (22-25) value churn is
  0.014-0.015 per update in the injected baseline against 0.0035-0.0048 in its control (3-4x), policy churn
  0.15-0.18 against 0.08-0.09 (2x); over the whole post-onset phase per seed: policy churn 0.113-0.147
  (control 0.079-0.099), out-of-batch 0.105-0.131 (control 0.068-0.090), value churn 0.006-0.013 (control
  0.006-0.008).
- Capacity goes with it: the share of dead ReLU units (no variation over the 60 states) jumps from 0.55 at
  onset to 0.70 in the first updating iteration of the injected baseline (control 0.58) and climbs to 0.84
  by the end (control 0.60); the injected baseline relearns only to tail means 0.28-0.56 (10/10 below 0.6)
  while its control reaches 0.61-0.80.
- CHAIN acts on exactly that: its injected value churn in iterations 22-25 is 0.0035-0.0056 (the control's
  level), policy churn 0.10-0.13, dead units stay at 0.60-0.65, and it relearns to 0.78-0.87 (0/10 fail),
  above the baseline's own control: with churn held down, the higher intensity speeds relearning, which is
  the paper's claim. Its own control is a little slower (tails 0.58-0.82, 2/10 below 0.6).
- Gradient clipping at 0.5 does not act on it (tails 0.28-0.58, 10/10 fail, rows nearly identical to the
  baseline's): the TD gradients here are rarely above the clip; the failure is not a gradient spike.
- Ablation (injected baseline, one factor back to the control's value, seeds 0-2 tails; calibrated 0.28
  0.52 0.28): target synced every 16 updates again (`target_every=0`): 0.81 0.76 0.75, no failure; lr x1
  (`lr_mult=1`): 0.79 0.63 0.71, no failure; replay ratio x1 (`updates_mult=1`): 0.37 0.23 0.39, still fails
  (the extra updates help). The moving target alone (lr x1, replay x1): 0.63 0.56 0.69, slower than
  the control (0.74 0.68 0.71) but mostly above 0.6. So the failure needs the larger step AND the moving target.
  Per-update churn alone does not discriminate: with the periodic target kept, lr x4 churns about as much
  (policy churn 0.105-0.125, value churn 0.009-0.011 post-onset means) and relearns to 0.75-0.81. What the
  moving target adds is the chain effect CHAIN's paper names: every update's value churn enters the next
  update's bootstrap target at once and compounds; CHAIN damps the per-update change (value churn at the
  control's level right after onset) and with it the compounding. The mechanism the task induces is
  therefore "churn propagated through a target synced every update at a larger step", with a rise of dead
  ReLU units (0.70 -> 0.84) going with the failure; which of the two is cause and which consequence was
  not separated (no run isolates dead units without the moving target).
- CHAIN's dose (its coefficient beta, injected CHAIN, seeds 0-2 tails; post-onset policy churn and value
  churn per update): beta 0.005: 0.24 0.70 0.45 (0.12-0.15, 0.009-0.012, as the baseline); 0.015: 0.62
  0.42 0.49 (0.13-0.14, 0.011-0.012); 0.05 (the paper's, calibrated): 0.84 0.83 0.84 (seeds 0-9: 0.08-0.12,
  0.007-0.009); 0.15: 0.83 0.85 0.68 (0.06-0.07, 0.004-0.007; slower healthy phase, onset returns 0.17-0.79).
  The rescue follows the churn reduction; its own healthy cost shows at large beta.

Calibration (quick: 60 iterations, onset 20; tail = mean exact return over iterations 40-59; failed = tail
below 0.6; normalized return = post-onset mean mapped through floor 0.0 and ceiling 0.5604):
| method | 0-9 failed | control failed | normalized [95% CI] | 100-109 failed | control failed | normalized [95% CI] |
|---|---|---|---|---|---|---|
| baseline | 10/10 | 0/10 | 0.691 [0.615, 0.761] | 9/10 | 1/10 | 0.702 [0.599, 0.794] |
| chain | 0/10 | 2/10 | 1.247 [1.200, 1.291] | 0/10 | 2/10 | 1.256 [1.218, 1.294] |
| grad-clip | 10/10 | 0/10 | 0.696 [0.623, 0.764] | - | - | - |
| no-update | 10/10 | 10/10 | 0.105 [0.051, 0.159] | 10/10 | 10/10 | 0.057 [0.017, 0.103] |
| frozen-at-onset | 10/10 | 10/10 | 0.000 [0.000, 0.000] | 10/10 | 10/10 | 0.000 [0.000, 0.000] |
Control normalized return: baseline 1.000 (seeds 0-9, by construction of the ceiling) and 0.976 (100-109);
CHAIN's control 0.957 and 0.851. Tail means, injected: baseline 0.28 0.52 0.28 0.56 0.50 0.47 0.51 0.40 0.48
0.49 (seeds 0-9), 0.31 0.57 0.22 0.45 0.44 0.55 0.65 0.43 0.48 0.48 (100-109); CHAIN 0.78-0.87 and 0.81-0.88;
baseline controls 0.61-0.80 and 0.60-0.80 (seed 109's 0.60 just below the threshold). `no-update` keeps the
initial network, whose greedy policy earns 0.00-0.11 under the new rule (tails). Files:
results/calibration/policy-churn/seeds-0-9 and seeds-100-109.

Seconds per (method, seed) at quick (healthy phase plus both branches; the injected branch runs twice the
updates, CHAIN a second forward pass per update), one thread on the shared 2-core machine: seeds 0-9 run
(load ~4) baseline 20-29, CHAIN 23-29, references 13-23; seeds 100-109 run (lighter load) baseline 9-18,
CHAIN 14-23, references 8-14: over the ~10 s aim for CHAIN even on a free core.

Version 1 (tanh trunk, lr x15 shock, no rule change) is summarized for the record: the shock saturated
66-100% of the tanh units in one iteration, Q went flat over states and churn rose as a symptom; CHAIN
could not help (10/10 fail) and `frozen-at-onset` scored 0.71 normalized because the post-onset phase did
not demand learning. With ReLU and lr x10 CHAIN helped on a knife-edge (fails 6/10 vs 1/10); replay ratio
x4 alone improved the return. Exploration for version 2 (seeds 0-5 only, injected tail means): with 16
updates per iteration and the target every 64 (too slow a control: tails 0.26-0.58), replay x4 + target
every update at lr x1 (tanh) did not fail (0.60-0.74); lr x10 failed for both baseline and CHAIN (tanh
0.01-0.04, ReLU 0.05-0.21); ReLU lr x3/x4 with replay x4 + target every update: baseline 0.08-0.69, CHAIN
0.83-0.88. With 32 updates and the target every 16 (the calibrated control), ReLU lr x3, replay x2: baseline
0.33-0.58, CHAIN 0.84-0.86; lr x4, replay x2 (calibrated): baseline 0.28-0.52 on seeds 0, 1, 4, 5.
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
WIDTH, DEPTH, ACTIVATION = 64, 2, "relu"
FROZEN_RANGE = 0.01  # a hidden unit is frozen if its activation varies less than this over all states

DQN_CONFIG = DQNConfig(num_envs=8, num_steps=16, updates_per_iteration=32, batch_size=64, ref_batch_size=64,
                       buffer_size=10_000, learning_rate=1e-3, adam_eps=1e-8, gamma=0.95, tau=1.0, target_every=16,
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

    def greedy_steps(self, greedy: np.ndarray, next_state: np.ndarray | None = None) -> np.ndarray:
        """Steps to the goal from every state under a deterministic policy (inf where it loops).

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
        """Exact expected return of the policy from the uniform random start: 1 - 0.9 t / T, 0 if t > T."""
        t = self.greedy_steps(greedy, next_state)
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

    lr_mult: float = 4.0  # learning rate x this from the first injected iteration on
    updates_mult: int = 2  # gradient updates per iteration (the replay ratio) x this, injected branch
    target_every: int = 1  # target-network sync period in updates from onset on, injected branch (0: unchanged)
    ramp: int = 0  # iterations over which the lr multiplier rises geometrically to lr_mult (0: all at once)
    shift: bool = True  # at onset, in BOTH branches, the action labels rotate (the new rule to learn)
    activation: str = ACTIVATION  # the Q-network's trunk nonlinearity ("tanh" or "relu")
    onset: int | None = None  # first injected iteration at the quick and full tiers (None: the tier's own)

    def check(self, shortest_run: int) -> None:
        def integer(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        if not (isinstance(self.lr_mult, (int, float, np.number)) and not isinstance(self.lr_mult, bool)
                and math.isfinite(self.lr_mult) and self.lr_mult > 0):
            raise StabenchError(f"policy-churn: lr_mult must be a finite number > 0, got {self.lr_mult!r}")
        if not (integer(self.updates_mult) and self.updates_mult >= 1):
            raise StabenchError(f"policy-churn: updates_mult must be an integer >= 1, got {self.updates_mult!r}")
        if not (integer(self.target_every) and self.target_every >= 0):
            raise StabenchError(f"policy-churn: target_every must be an integer >= 0, got {self.target_every!r}")
        if not (integer(self.ramp) and self.ramp >= 0):
            raise StabenchError(f"policy-churn: ramp must be an integer >= 0, got {self.ramp!r}")
        if not isinstance(self.shift, bool):
            raise StabenchError(f"policy-churn: shift must be a bool, got {self.shift!r}")
        if self.activation not in ("tanh", "relu"):
            raise StabenchError(f"policy-churn: activation must be 'tanh' or 'relu', got {self.activation!r}")
        if self.onset is not None and not (integer(self.onset) and 0 < self.onset < shortest_run):
            raise StabenchError(
                f"policy-churn: onset must be an integer in 1..{shortest_run - 1} (inside every quick and full run), "
                f"got {self.onset!r}"
            )


# ---- the new rule at onset: the action labels rotate -------------------------------------------------------------
ROTATION = np.array([1, 2, 0])
EPS_RESTART = 1.0  # after onset, the learner's action a executes MiniGrid action ROTATION[a]


class RelabeledEnvs:
    """The vector env with the learner's actions relabeled: `step(a)` executes `perm[a]` (all else passes)."""

    def __init__(self, envs: gym.vector.SyncVectorEnv, perm: np.ndarray) -> None:
        self.envs, self.perm = envs, np.asarray(perm)

    def step(self, actions: np.ndarray) -> tuple:
        return self.envs.step(self.perm[np.asarray(actions)])

    def reset(self, **kwargs: Any) -> tuple:
        return self.envs.reset(**kwargs)


class RelabelDQN(DQN):
    """The DQN trainer with exploration that restarts when the rule changes (`epsilon_origin`, set at onset)."""

    epsilon_origin: int | None = None

    def epsilon(self) -> float:
        if self.epsilon_origin is None:
            return super().epsilon()
        frac = min(1.0, (self.global_step - self.epsilon_origin) / max(1, self.cfg.exploration_steps))
        return EPS_RESTART + frac * (self.cfg.end_e - EPS_RESTART)


# ---- one run ----------------------------------------------------------------------------------------------------
class PolicyChurnRun:
    """One seed: the vector env, the Q-network, its target, Adam, the replay buffer and the generator all live
    in `self.trainer`, so `copy.deepcopy` branches everything."""

    def __init__(self, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...], knobs: Knobs,
                 onset: int) -> None:
        self.cfg = replace(DQN_CONFIG, seed=seed)
        self.table = state_table()
        self.next_state = self.table.next_state
        envs = make_vector_env(ENV_ID, self.cfg.num_envs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = QNetwork(q_spec(OBS_DIM, N_ACTIONS, WIDTH, DEPTH, knobs.activation))
            self.trainer = RelabelDQN(envs, model, self.cfg, stabilizer, heldout_obs=self.table.obs)
        self.diagnostics, self.knobs, self.onset = diagnostics, knobs, onset
        self.iteration = 0
        self.injected_iterations = 0

    def lr_multiplier(self) -> float:
        k, ramp = self.injected_iterations, self.knobs.ramp
        return self.knobs.lr_mult ** (min(k, ramp) / ramp) if ramp else self.knobs.lr_mult

    def start_new_rule(self) -> None:
        """Onset, both branches: the actions are relabeled, the replay (of the old rule) is emptied and
        exploration restarts (epsilon from EPS_RESTART down to end_e over exploration_steps env steps)."""
        tr = self.trainer
        tr.envs = RelabeledEnvs(tr.envs, ROTATION)
        self.next_state = self.table.next_state[:, ROTATION]
        tr.buffer.size, tr.buffer.pos = 0, 0
        tr.cfg = replace(tr.cfg, learning_starts=tr.global_step + tr.cfg.learning_starts)
        tr.epsilon_origin = tr.global_step

    def step(self, injected: bool) -> dict[str, float]:
        if self.iteration == self.onset and self.knobs.shift:
            self.start_new_rule()
        self.iteration += 1
        if injected:
            self.injected_iterations += 1
            self.trainer.set_intensity(self.cfg.updates_per_iteration * self.knobs.updates_mult,
                                       self.cfg.learning_rate * self.lr_multiplier())
            if self.knobs.target_every and self.injected_iterations == 1:
                self.trainer.cfg = replace(self.trainer.cfg, target_every=self.knobs.target_every)
        state = self.trainer.iterate()
        q = state.extras["heldout_q"][-1]
        greedy = q.argmax(-1).numpy()
        share = np.bincount(greedy, minlength=N_ACTIONS) / len(greedy)  # the greedy policy's action marginal
        row = {
            "step": float(state.extras["global_step"]),
            "return": self.table.greedy_return(greedy, self.next_state),
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
    version = "2"
    trainer = "dqn"
    budgets = {
        "smoke": Budget(iterations=6, onset=3, seeds=1, report_every=1),
        "quick": Budget(iterations=60, onset=20, seeds=5),
        "full": Budget(iterations=120, onset=40, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=0.6, fails_when="below", reduce="tail_mean", tail=1 / 3)
    matched_fix = "chain"
    methods = ("baseline", "chain", "grad-clip")
    detector = DetectorSpec(metric="value_churn", threshold=0.02)  # chosen on seeds 100-109 (docstring)
    diagnostics = ("churn", "grad_norms")
    return_floor = 0.0  # frozen-at-onset's post-onset return, seeds 0-9 (exactly 0: every frozen policy loops)
    return_ceiling = 0.5604  # the baseline control's mean post-onset return, seeds 0-9 (docstring)
    experimental = True

    knobs_type = Knobs

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> PolicyChurnRun:
        self.budget(tier)  # validates the tier
        return PolicyChurnRun(seed, stabilizer, self.diagnostics, self.knobs, self.budget(tier).onset)

    def grid(self, name: str, tier: str) -> list[dict[str, Any]]:
        """`stabench run --grid intensity`: learning-rate x replay-ratio multipliers at onset, one trial per cell."""
        if name != "intensity":
            return super().grid(name, tier)
        return [{"lr_mult": lr, "updates_mult": u} for lr, u in product((1.0, 3.0, 10.0, 15.0, 30.0), (1, 4))]
