"""parallel-staleness: with lagged actors and the ratio taken against their stored log-probabilities (classic
asynchronous PPO), the clipped objective drags the learner back onto the actors' stale policy.

Named after asynchronous / parallel data collection (IMPALA-style actors whose parameters lag the learner's;
Mayor et al. 2025 on envs x rollout length x epochs).

Setting (everything the task fixes lives in `Knobs`; the defaults are calibrated):
- World: MiniGrid's empty 6x6 room (4x4 free cells, start top-left facing right, goal bottom-right), timeout
  30 steps, flat 147-dim view / 10, 3 actions: optimum 1 - 0.9 * 7/30 = 0.79, uniform-random policy 0.036.
  Stepped by `RoomVectorEnv`, a table of MiniGrid's own observations and transitions for the 60 (cell,
  direction) states (the tests check it step for step against MiniGrid in a same-step-autoreset
  SyncVectorEnv), because MiniGrid re-renders its view on every step.
- Trainer: PPO (baselines/ppo.py), separate policy and value MLPs 147-64-64 tanh (CleanRL init), 8 envs x 64
  steps, 4 minibatches, Adam lr 2.5e-4 eps 1e-5, gamma 0.99, lambda 0.95, clip 0.2, entropy 0.01, value
  coefficient 0.5, no gradient clipping; 4 epochs per update before onset, 10 from onset on in BOTH branches
  (the control gets the extra reuse, not the lag).
- Injection (injected branch, from the onset update on): the actors collect with the learner's parameters of
  `lag` = 16 updates before (the trainer's snapshot queue, `PPO.actor_lag`); while fewer snapshots exist they
  use the oldest, the initial parameters. At the quick tier's onset (update 10) that means: updates 10-26
  collected by the initial, near-uniform policy, then by the learner of 16 updates before. The baseline's ratio
  is pi_theta / pi_behaviour with the actors' STORED log-probabilities; values and pi_old (`old_logprobs`) come
  from the learner.
- Score: the LEARNER's own policy, evaluated exactly, not the actors' episodes: `return` is the expected return
  of the stochastic learner policy from the start, by dynamic programming over the 60 states (the limit of
  infinitely many evaluation episodes; the tests check it against Monte Carlo); `entropy` is the learner's
  entropy averaged over the states it visits. The actors' episode returns are `actor_return`.
- Ground truth: the run fails if the learner's mean return over the last 20% (updates 40-49) is below 0.4, half
  the room's optimum: the recipe's criterion was "below 50% of the same seed's control", and the control
  reaches the optimum on nearly every calibration seed. Matched fix: `vtrace`. Named non-fix: `dual-clip`
  (c = 3). Also: `token-tis` (decoupled PPO's truncated weight min(pi_old / pi_behaviour, 2) around pi_old).
- What must be learned after onset: at onset (update 10) the learner is far from the room's optimum, so the
  post-onset phase is the bulk of the learning in BOTH branches; a learner that stops learning fails
  (`frozen-at-onset` keeps its onset return, `no-update` the near-uniform initial policy's).
- Normalized return: `return_floor` = 0.182 is what the policy FROZEN AT ONSET earns, the exact (DP) return of
  each seed's onset policy averaged over the calibration seeds 0-9 (measured once, fixed); `return_ceiling` =
  0.79 is the room's optimum, exact. So 0 = stops learning at onset, 1 = optimal from the first post-onset update.
- Seeds each setting was chosen on: the knobs, budgets and the 0.4 threshold on seeds 0-9 (lag and horizon
  checks on seeds 0-2), the floor on seeds 0-9, the detector (clip fraction above 0.25) on seeds 100-109 only.
  `behaviour_kl` and `rho_out_of_clip` are exactly 0 without lag, so they separate by construction and are
  reported, not used.

Mechanism, as measured:
- Not a ratio blow-up: post-onset ratios against the stored log-probs stay moderate, and `dual-clip` almost
  never binds (its rows nearly equal the baseline's).
- The clipped objective is a trust region around the BEHAVIOUR policy. Once a sample's ratio is outside
  [0.8, 1.2], only the term that moves pi_theta back toward pi_behaviour keeps a gradient (A > 0 on an action
  the learner made rarer than the actor; A < 0 on one it made likelier). On the first injected update nearly
  every sample starts outside the clip range, and that one update collapses the learner onto the initial
  policy (its entropy goes to ln 3, its return to the uniform policy's).
- After that the learner stays on its actors: it is its own policy of 16 updates before plus one update of
  progress. The return is a sawtooth of period = lag: it climbs while the actors replay older snapshots and
  falls whenever they reach the snapshot taken after the first injected update. Learning is about lag times
  slower and keeps restarting from the stale policy; the baseline ends below the frozen policy.
- The fixes keep the data and the lag but take the trust region around the learner's pi_old: `vtrace`
  reaches the optimum on most seeds, `token-tis` more slowly and not on every seed. That V-trace's advantage
  comes from its corrected critic targets is plausible but untested.
- Fragile points: at lag 8 (< onset: a real lag throughout) the baseline is slowed, not failed; over a
  100-update run the baseline recovers, and at lag 32 the fixes are not robust. Staleness here is a slowdown
  with restarts, so the horizon must be short beside lag x (updates per unit of progress): the full tier
  therefore runs the quick protocol over 10 seeds instead of a longer run.

The staleness map (`stabench run --grid staleness`, `staleness_grid`): envs x epochs at a fixed batch of 512
env steps per update, x lag, baseline. Measured numbers, per seed set, and the map: results/calibration.md
(runs in results/matrix, results/calibration/parallel-staleness/ and results/staleness-grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
import torch
from minigrid.envs import EmptyEnv
from stabench.baselines.models import sequential
from stabench.baselines.ppo import PPO, PPOConfig
from stabench.suite import outcomes
from stabench.suite.api import (
    BEHAVIOUR_POLICY,
    Budget,
    DetectorSpec,
    Figure,
    GroundTruth,
    StabenchError,
    Stabilizer,
    Task,
    TrainState,
)
from stabench.suite.diagnostics import DiagnosedRun, diagnostic
from stabench.suite.figures import Skip, need, save
from stabench.tasks.worlds import grids
from stabench.tasks.worlds.grids import N_ACTIONS, flatten_minigrid, room_table
from torch import nn

if TYPE_CHECKING:
    import pandas as pd

OBS_DIM = 147  # 7 x 7 x 3 egocentric view, flattened


# ---- the world ------------------------------------------------------------------------------------------
def make_room(size: int, max_steps: int) -> gym.Env:
    """MiniGrid's empty room (fixed start top-left facing right, goal bottom-right), flat interface."""
    return flatten_minigrid(EmptyEnv(size=size, max_steps=max_steps))


class RoomVectorEnv(grids.RoomVectorEnv):
    """The shared `grids.RoomVectorEnv` (MiniGrid's empty room stepped from its table, same-step autoreset,
    true episode statistics), built as this task builds it, with the success reward in the order of operations
    its committed rows were made with: 1.0 - 0.9 * t / T, which differs from MiniGrid's 1 - 0.9 * (t / T) in
    the last bit at some t (tests/test_staleness.py checks the rest against MiniGrid exactly)."""

    def __init__(self, size: int, max_steps: int, num_envs: int) -> None:
        super().__init__(num_envs, size, max_steps)

    @staticmethod
    def reward(t: np.ndarray, max_steps: int) -> np.ndarray:
        return 1.0 - 0.9 * t / max_steps


# ---- the network ----------------------------------------------------------------------------------------
def _ortho(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class SeparateActorCritic(nn.Module):
    """CleanRL's discrete-action agent: separate tanh MLPs for the policy and the value (no shared trunk)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.spec = {"obs_dim": OBS_DIM, "n_actions": N_ACTIONS, "width": width, "depth": 2}
        g = math.sqrt(2.0)
        self.actor = nn.Sequential(_ortho(OBS_DIM, width, g), nn.Tanh(), _ortho(width, width, g), nn.Tanh(),
                                   _ortho(width, N_ACTIONS, 0.01))
        self.critic = nn.Sequential(_ortho(OBS_DIM, width, g), nn.Tanh(), _ortho(width, width, g), nn.Tanh(),
                                    _ortho(width, 1, 1.0))
        self.policy = self.actor[-1]  # the policy head, by the name feature regularizers look for

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sequential(self.actor, obs), sequential(self.critic, obs).squeeze(-1)


# ---- diagnostics ----------------------------------------------------------------------------------------
@diagnostic("behaviour_ratio")
def behaviour_ratio(state: TrainState) -> dict[str, float]:
    """The importance ratio rho = pi_old / pi_behaviour of the rollout's actions at the start of the update
    (`batch["old_logp"]` vs the stored `batch["behaviour_logp"]`): p99, max, the share outside [1 - eps, 1 + eps]
    for eps = 0.2 (samples whose clipped ratio starts out of range), and Kish ESS / N."""
    rho = (state.batch["old_logp"] - state.batch["behaviour_logp"]).exp().double()
    return {
        "rho_p99": float(torch.quantile(rho, 0.99)),
        "rho_max": float(rho.max()),
        "rho_out_of_clip": float(((rho - 1.0).abs() > 0.2).double().mean()),
        "rho_ess": float(rho.mean() ** 2 / (rho.pow(2).mean())),
    }


# ---- knobs ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knobs:
    """What the task fixes; every field is a keyword argument of `ParallelStaleness` (the staleness grid)."""

    lag: int = 16  # updates the actors' parameters lag the learner's, from onset on (injected branch only)
    num_envs: int = 8
    num_steps: int = 64  # rollout length per env; batch = num_envs * num_steps
    epochs: int = 10  # epochs per update from onset on (both branches)
    epochs_before: int = 4  # epochs per update before onset
    num_minibatches: int = 4
    learning_rate: float = 2.5e-4
    width: int = 64
    size: int = 6  # the empty room is size x size cells, walls included
    max_steps: int = 30
    onset: int | None = None  # overrides the quick and full tiers' onset iteration

    def check(self, shortest_run: int) -> None:
        """Raise StabenchError, with one line naming the knob, for any value the task cannot run with (the
        onset is checked by `Task.__init__`)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "onset":
                continue
            if f.name == "learning_rate":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                         and value > 0):
                    raise StabenchError(f"parallel-staleness: learning_rate must be a number > 0, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int):
                raise StabenchError(f"parallel-staleness: knob {f.name} must be an integer, got {value!r}")
        if self.lag < 0:
            raise StabenchError(f"parallel-staleness: lag must be >= 0 updates, got {self.lag}")
        for name in ("num_envs", "num_steps", "epochs", "epochs_before", "num_minibatches", "width", "max_steps"):
            if getattr(self, name) < 1:
                raise StabenchError(f"parallel-staleness: {name} must be >= 1, got {getattr(self, name)}")
        if (self.num_envs * self.num_steps) % self.num_minibatches:
            raise StabenchError(f"parallel-staleness: the batch of {self.num_envs} x {self.num_steps} does not split "
                                f"into {self.num_minibatches} minibatches")
        if self.size < 4:
            raise StabenchError(f"parallel-staleness: size must be >= 4, got {self.size}")


# ---- the staleness grid (Mayor et al. 2025: envs x rollout length x epochs, here x lag) ---------------------
GRID_BATCH = 512  # env steps per update in every cell: more envs means shorter rollouts
GRID: dict[str, dict[str, tuple[int, ...]]] = {
    "quick": {"num_envs": (4, 8, 16), "epochs": (2, 4, 10), "lag": (4, 16)},
    "full": {"num_envs": (2, 4, 8, 16, 32), "epochs": (1, 2, 4, 10, 20), "lag": (4, 8, 16, 32)},
}


def staleness_grid(tier: str) -> list[dict[str, int]]:
    """Knob settings of the staleness map: one `ParallelStaleness(**cell)` per cell, all at the same batch of
    `GRID_BATCH` env steps per update (`num_steps = GRID_BATCH // num_envs`); `epochs` is the reuse after onset."""
    if tier not in GRID:
        raise StabenchError(f"unknown tier {tier!r} for the staleness grid; choose from {', '.join(GRID)}")
    axes = GRID[tier]
    return [{"num_envs": n, "num_steps": GRID_BATCH // n, "epochs": e, "lag": k}
            for k, e, n in product(axes["lag"], axes["epochs"], axes["num_envs"])]


class ParallelStalenessRun(DiagnosedRun):
    """One seed; the trainer (envs, learner, lagged-actor snapshots, Adam, sampling generator) lives in it."""

    def __init__(self, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...], knobs: Knobs,
                 onset: int) -> None:
        self.knobs, self.onset, self.diagnostics = knobs, onset, diagnostics
        cfg = PPOConfig(num_envs=knobs.num_envs, num_steps=knobs.num_steps, learning_rate=knobs.learning_rate,
                        adam_eps=1e-5, gamma=0.99, gae_lambda=0.95, update_epochs=knobs.epochs_before,
                        num_minibatches=knobs.num_minibatches, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5,
                        seed=seed)
        envs = RoomVectorEnv(knobs.size, knobs.max_steps, knobs.num_envs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = SeparateActorCritic(knobs.width)
            self.trainer = PPO(envs, model, cfg, stabilizer)
        self.trainer.actor_history = knobs.lag
        self.table = room_table(knobs.size, knobs.max_steps)

    def train(self, injected: bool) -> tuple[dict[str, float], TrainState]:
        tr = self.trainer
        if tr.iteration >= self.onset:
            tr.cfg.update_epochs = self.knobs.epochs
            tr.actor_lag = self.knobs.lag if injected else 0
        state = tr.iterate()
        with torch.no_grad():
            ret, ent = self.table.evaluate(tr.model(self.table.obs)[0])
        row = {
            "step": float(state.extras["global_step"]),
            "return": ret,  # the learner's exact expected return
            "entropy": ent,  # the learner's entropy on the states it visits
            "actor_return": state.extras["episode_return"],  # what the (lagged) actors scored
            "actor_entropy": state.losses["entropy"],
            "actor_lag": float(state.extras["actor_lag"]),
            "behaviour_kl": state.extras["behaviour_kl"],
            "policy_loss": state.losses["policy_loss"],
            "value_loss": state.losses["value_loss"],
            "approx_kl": state.losses["approx_kl"],
            "clip_frac": state.losses["clip_frac"],
            "ratio_p99": state.losses["ratio_p99"],
            "ratio_max": state.losses["ratio_max"],
        }
        return {k: float(v) for k, v in row.items()}, state


def draw_staleness(table: pd.DataFrame, out: Path, name: str) -> list[Path]:
    """The staleness grid: return kept (injected / control) over envs x epochs, one panel per lag."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = need(table, "parallel-staleness")
    knobs = ["knob_num_envs", "knob_epochs", "knob_lag"]
    if any(k not in rows for k in knobs) or rows[knobs].drop_duplicates().shape[0] < 2:
        raise Skip("the results hold no staleness grid (run `stabench run --grid staleness`)")
    rows = rows[rows["method"] == "baseline"]
    per_run = outcomes.outcomes(rows)
    cells = rows.groupby("cell")[knobs].first()
    per_run["cell"] = per_run["task"].str.extract(r"\[(.*)\]")[0]
    per_run = per_run.join(cells, on="cell")
    pivot = per_run.pivot_table(index=["cell", "seed", *knobs], columns="variant", values="post_onset_return")
    pivot["kept"] = pivot["injected"] / pivot["control"]
    data = pivot.reset_index()
    lags = sorted(data["knob_lag"].unique())
    fig, axes = plt.subplots(1, len(lags), figsize=(5 * len(lags), 4), squeeze=False)
    for ax, lag in zip(axes[0], lags):
        grid = data[data["knob_lag"] == lag].pivot_table(index="knob_num_envs", columns="knob_epochs", values="kept")
        sns.heatmap(grid, annot=True, fmt=".2f", cmap="viridis", vmin=0, vmax=1.2, ax=ax,
                    cbar_kws={"label": "return kept (injected / control)"})
        ax.set_title(f"actors lag {lag} updates (mean over seeds)")
        ax.set_xlabel("epochs of reuse")
        ax.set_ylabel("parallel environments (batch fixed)")
    return save(fig, out, name)


class ParallelStaleness(Task):
    id = "parallel-staleness"
    family = "grids"
    version = "2"
    trainer = "ppo"
    budgets = {
        "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=50, onset=10, seeds=5),
        "full": Budget(iterations=50, onset=10, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=0.4, fails_when="below", reduce="tail_mean", tail=0.2)
    matched_fix = "vtrace"
    methods = ("baseline", "token-tis", "vtrace", "dual-clip")
    detector = DetectorSpec(metric="clip_frac", threshold=0.25)
    diagnostics = ("behaviour_ratio",)
    privileged = ("actor_lag",)  # the injected lag is the ground truth of what was done to the run
    provides = frozenset({BEHAVIOUR_POLICY})  # lagged actors sample
    # The policy frozen at onset: its exact (DP) return, mean over calibration seeds 0-9 (see the docstring).
    return_floor = 0.182
    return_ceiling = 1.0 - 0.9 * 7 / 30  # the room's optimum, exact: 0.79

    knobs_type = Knobs
    figures = (
        Figure("grid", "staleness grid",
               "The staleness grid of parallel-staleness (`stabench run --grid staleness`, baseline): the return "
               "kept after onset (injected over control, mean over seeds) over parallel environments and epochs "
               "of reuse at a fixed batch, one panel per actor lag.",
               draw_staleness, grid_cells=True),
    )
    paper = (
        "On parallel-staleness the actors collect, from onset on, with the learner's parameters of 16 updates "
        "before, and the baseline forms its clipped ratio against their stored log-probabilities, as classic "
        "asynchronous PPO does; the learner still has most of the room to learn after onset. The ratios do not "
        "blow up: the clipped objective is a trust region around the actors' stale policy, so once a sample's "
        "ratio leaves the clip range only the term that pulls the learner back toward the actors keeps a "
        "gradient. The first injected update collapses the learner onto its near-uniform initial policy, and "
        "from then on it is its own policy of 16 updates before plus one update of progress: learning is about "
        "as many times slower as the lag and keeps restarting, and the baseline ends below the policy frozen at "
        "onset. Dual clip, which bounds large ratios, changes nothing; V-trace keeps the data and the lag but "
        "takes the trust region around the learner's own policy and learns the room. Over a grid of parallel "
        "environments, epochs of reuse and lags at a fixed batch, the lag dominates what is kept; more epochs of "
        "reuse do not hurt here, because the pull onto the stale actors acts at any epoch count."
    )

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> ParallelStalenessRun:
        budget = self.budget(tier)
        return ParallelStalenessRun(seed, stabilizer, self.diagnostics, self.knobs, budget.onset)

    def grid(self, name: str, tier: str) -> list[dict[str, Any]]:
        """`stabench run --grid staleness`: the map of where stability breaks, one trial per cell."""
        if name != "staleness":
            return super().grid(name, tier)
        return staleness_grid(tier)
