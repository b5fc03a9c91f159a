"""parallel-staleness: with lagged actors and the ratio taken against their stored log-probabilities (classic
asynchronous PPO), the clipped objective drags the learner back onto the actors' stale policy.

Named after asynchronous / parallel data collection (IMPALA-style actors whose parameters lag the learner's;
Mayor et al. 2025 on envs x rollout length x epochs). Prototype: /work/shared/RECIPES.md, "parallel-staleness".

Setting (everything the task fixes lives in `Knobs`; the defaults are calibrated):
- World: MiniGrid's empty 6x6 room (4x4 free cells, start top-left facing right, goal bottom-right), timeout
  30 steps, flat 147-dim view / 10, 3 actions: optimum 1 - 0.9 * 7/30 = 0.79, uniform-random policy 0.036.
  Stepped by `RoomVectorEnv`, a table of MiniGrid's own observations and transitions for the 60 (cell,
  direction) states (the tests check it step for step against MiniGrid in a same-step-autoreset
  SyncVectorEnv): 1.1 us per env step instead of 87 us.
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
- Ground truth: the run fails if the learner's mean return over the last 20% (updates 40-49) is below 0.4. The
  recipe's criterion was "below 50% of the same seed's control"; GroundTruth takes an absolute threshold, and
  the control reaches the optimum 0.79 on 9 of 10 seeds (0.69 on seed 9), so 0.4 is half the optimum, i.e.
  half the control's level. Matched fix: V-trace. Named non-fix: dual clip (c = 3). Also: decoupled PPO.
- What must be learned after onset (issue 12, "not learning must not win"): at onset (update 10) the learner
  is far from the room's optimum, so the post-onset phase is the bulk of the learning in BOTH branches: the
  control climbs from 0.09-0.24 to 0.79. A learner that stops learning fails: `frozen-at-onset` keeps its
  onset return (tail 0.09-0.24 < 0.4, 10/10 failed in both branches), `no-update` the initial policy's 0.036.
- Normalized return (version 2): `return_floor` = 0.182 is what the policy FROZEN AT ONSET earns, the exact
  (DP) return of each seed's onset policy averaged over the calibration seeds 0-9 (0.18 0.21 0.16 0.20 0.22
  0.09 0.14 0.24 0.20 0.19; measured once, fixed); `return_ceiling` = 0.79 is the room's optimum, exact. So 0
  = stops learning at onset, 1 = optimal from the first post-onset update; the control's post-onset mean
  normalizes to 0.81 on seeds 0-9 (it needs 8-16 updates to reach 0.7). Version 1 anchored on 0 and 0.79. The
  training code is unchanged from version 1 (same rows; the staleness grid is unaffected).
- Seeds each setting was chosen on: the knobs, budgets and the 0.4 threshold are version 1's, chosen on seeds 0-9
  (lag and horizon checks on seeds 0-2); version 2 chose the floor on seeds 0-9 and the detector threshold on seeds
  100-109.

Mechanism, as measured (quick tier, seeds 0-9):
- Not a ratio blow-up: post-onset ratios (vs the stored log-probs) have p99 1.23-1.28 and max 2.05-3.11 per
  run. Dual clip binds in 1 update of 400 (seed 7, update 44) and moves the return by at most 0.0012; every
  other row equals the baseline's.
- The clipped objective is a trust region around the BEHAVIOUR policy. Once a sample's ratio is outside
  [0.8, 1.2], only the term that moves pi_theta back toward pi_behaviour keeps a gradient (A > 0 on an action
  the learner made rarer than the actor; A < 0 on one it made likelier). On the first injected update 100% of
  samples start outside the clip range on 9 seeds (65% on seed 5), and that one update collapses the learner
  onto the initial policy: KL(actors || learner) 0.09-0.49 before it, 0.000-0.009 after; the learner's entropy
  0.66-1.02 -> 1.09-1.10 (ln 3 = 1.099), its return 0.09-0.24 -> 0.03-0.05.
- After that the learner stays on its actors (post-onset mean KL(actors || learner) 0.02-0.05; fixes 0.42-0.91;
  19-27% of samples start each update outside the clip range; clip fraction 0.14-0.18, control 0.02-0.03), so
  it is its own policy of 16 updates before plus one update of progress. The return is a sawtooth of period =
  lag: it climbs while the actors replay the healthy-phase snapshots (0.13-0.34 at update 26), falls at update
  27 (to 0.03-0.10) when they reach the snapshot taken after the first injected update, climbs to 0.21-0.46 by
  update 43 and falls again at update 44 (0.05-0.21). Tail means 0.15-0.29; learner entropy in the tail
  0.89-1.03. Learning is ~lag times slower and keeps restarting from the stale policy.
- The fixes keep the data and the lag but take the trust region around the learner's pi_old. V-trace reaches
  a return of 0.7 at updates 19-37 (control 18-26) and ends at the optimum on 8/10 seeds; decoupled PPO
  (weight min(pi_old / pi_behaviour, 2), no off-policy correction of GAE or of the critic's targets) reaches
  0.7 at updates 32-41 on 6/10 seeds and not within the run on 4. That V-trace's advantage comes from its
  corrected critic targets is plausible but untested.
- Fragile points (seeds 0-1 unless said): at lag 8 (< onset: a real lag throughout) the baseline ends at 0.51
  0.48 (slowed, not failed at 0.4). Over a 100-update run with onset 20 and lag 16 the baseline recovers to 0.68
  0.68 and decoupled PPO collapsed late on seed 0 (0.79 -> 0.00 near update 78, entropy 0.01); at lag 32 the
  fixes are not robust (V-trace 0.79 0.79 0.08, decoupled 0.26 0.49 0.73 on seeds 0-2). Staleness here is a
  slowdown with restarts, so the horizon must be short beside lag x (updates per unit of progress): the full
  tier therefore runs the quick protocol over 10 seeds instead of a longer run.

Calibration (quick: 50 updates, onset 10; learner tail-mean return over updates 40-49; failed = below 0.4;
re-run 2026-11-23 with the PPO trainer's fused Adam: equal to the foreach run at two decimals but for
V-trace's seeds 5 and 8, which were 0.71 and 0.41):
| method | injected, seeds 0-4 | failed | control failed |
|---|---|---|---|
| baseline | 0.23 0.25 0.24 0.22 0.24 | 5/5 (10/10 on seeds 0-9) | 0/5 (0/10) |
| vtrace | 0.79 0.79 0.79 0.79 0.79 | 0/5 (0/10; seeds 5-9: 0.69 0.79 0.79 0.53 0.79) | 0/5 (0/10) |
| decoupled-ppo | 0.46 0.75 0.78 0.71 0.78 | 0/5 (1/10; seeds 5-9: 0.47 0.39 0.75 0.73 0.51) | 0/5 (0/10) |
| dual-clip | 0.23 0.25 0.24 0.22 0.24 | 5/5 (10/10) | 0/5 (0/10) |
Control tails: 0.79 on every seed but seed 9 (0.69) for baseline, decoupled PPO and dual clip (whose controls are
plain PPO), and for V-trace 0.79 but seeds 3 and 5 (0.76 0.78). Full = quick over seeds 0-9: the numbers in
brackets. One thread: 6.6-7.9 CPU-s per (method, seed) at quick (healthy phase plus both branches). Detector:
clip fraction above 0.25, chosen (version 2) ONLY on seeds 100-109 (baseline runs): there the healthy rows reach
at most 0.13, the control rows 0.12-0.24 per seed (0.2 would alarm on 3 of 10 controls, 0.25 on none), and the
injected branch crosses 0.25 at its first injected update on 8 of 10 seeds (its first-update value is 0.13-0.67),
on seed 108 at update 16 and on seed 103 only at update 46; version 1 had 0.25 from seeds 0-9 (behaviour_kl and
rho_out_of_clip are exactly 0 without lag, so they separate by construction and are reported, not used).

Calibration, version 2 (normalized on the version-2 anchors; quick tier, seeds 0-9, with the references):
| method | failed (injected) | control failed | normalized return [95% CI] | control normalized |
|---|---|---|---|---|
| baseline | 10/10 | 0/10 | -0.062 [-0.086, -0.043] | 0.81 |
| vtrace | 0/10 | 0/10 | 0.676 [0.599, 0.744] | 0.79 |
| decoupled-ppo | 1/10 | 0/10 | 0.325 [0.210, 0.441] | 0.81 |
| dual-clip | 10/10 | 0/10 | -0.062 [-0.086, -0.043] | 0.81 |
| frozen-at-onset | 10/10 | 10/10 | -0.000 [-0.045, 0.038] | -0.00 |
| no-update | 10/10 | 10/10 | -0.241 [-0.241, -0.241] | -0.24 |
The baseline scores below the frozen policy: the pull onto the near-uniform initial actors costs it more than
stopping at onset would (post-onset mean 0.14 against 0.18). Fresh seeds 100-109 (nobody tuned on them):
| method | failed (injected) | control failed | normalized return [95% CI] | control normalized |
|---|---|---|---|---|
| baseline | 10/10 | 0/10 | -0.083 [-0.109, -0.060] | 0.797 |
| vtrace | 0/10 | 0/10 | 0.624 [0.536, 0.703] | 0.78 |
| frozen-at-onset | 10/10 | 10/10 | -0.094 [-0.158, -0.032] | -0.09 |
| no-update | 10/10 | 10/10 | -0.241 [-0.241, -0.240] | -0.24 |
Tails on seeds 100-109: baseline 0.13-0.25, its control 0.79 on every seed, V-trace 0.72-0.79. The onset
policies of these seeds are weaker (exact return 0.02-0.22, mean 0.125, against the fixed floor 0.182), so
the frozen reference normalizes to -0.09 and the baseline's control to 0.797: a hair under the bar's 0.8 with
the floor measured on seeds 0-9 (0.81 there); not re-tuned.

Staleness map (`staleness_grid("quick")`: 512 env steps per update, envs 4/8/16 x rollout 128/64/32, epochs
after onset 2/4/10, lag 4/16; baseline, seeds 0-2; return kept = injected / control tail mean, averaged):
| lag | epochs | 4 envs | 8 envs | 16 envs |
|---|---|---|---|---|
| 4 | 2 | 0.52 | 0.49 | 0.60 |
| 4 | 4 | 0.48 | 0.53 | 0.63 |
| 4 | 10 | 0.78 | 0.89 | 0.89 |
| 16 | 2 | 0.22 | 0.20 | 0.21 |
| 16 | 4 | 0.19 | 0.19 | 0.21 |
| 16 | 10 | 0.26 | 0.31 | 0.29 |
The lag dominates. More envs at equal batch help a little at lag 4 (0.59, 0.64, 0.71 averaged over epochs)
and not at lag 16 (0.22-0.24). More reuse does NOT hurt here, against the source's prediction: the share kept
rises with epochs (lag 4: 0.54 0.55 0.85; lag 16: 0.21 0.20 0.29), because the pull onto the actors' policy
acts at any epoch count (post-onset learner entropy 1.02-1.05 in every lag-16 cell) while more epochs buy more
progress per update. 254 CPU-s for the 54 trials.

Suite 0.3.0 re-measured on seeds 0-9 in the method matrix (`results/matrix`): PPO now hands its hooks the
shared schema (`behaviour_logp` for the stored log-probs, `old_logp` for the learner's), `decoupled-ppo` is
the one `token-tis` (the same truncated weight min(pi_old / q, 2) around pi_old), and every row of the
baseline, `vtrace`, `token-tis`, `dual-clip` and both references equals 0.2.0's. Baseline 10/10 fail (control
0/10, 0.81); vtrace 0/10, 0.68 [0.60, 0.74]; token-tis 1/10, 0.33; references 10/10.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from itertools import product
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from minigrid.envs import EmptyEnv
from stabench.baselines.ppo import PPO, PPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, StabenchError, Stabilizer, Task, TrainState
from stabench.suite.diagnostics import DIAGNOSTICS, diagnostic
from stabench.tasks.grids import N_ACTIONS, flatten_minigrid, room_table
from torch import nn

OBS_DIM = 147  # 7 x 7 x 3 egocentric view, flattened


# ---- the world ------------------------------------------------------------------------------------------
def make_room(size: int, max_steps: int) -> gym.Env:
    """MiniGrid's empty room (fixed start top-left facing right, goal bottom-right), flat interface."""
    return flatten_minigrid(EmptyEnv(size=size, max_steps=max_steps))



class RoomVectorEnv(gym.vector.VectorEnv):
    """`num_envs` empty rooms stepped together from the `RoomTable`: the same observations, transitions,
    rewards and 30-step (`max_steps`) truncation as `make_room` in a `SyncVectorEnv` with same-step autoreset
    and `RecordEpisodeStatistics` (tests/test_staleness.py checks it against MiniGrid), about 20x cheaper
    per step, because MiniGrid re-renders its egocentric view on every step. Finished episodes are reported
    in `info["final_info"]["episode"]["r"/"l"]` under the mask `info["final_info"]["_episode"]`."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, size: int, max_steps: int, num_envs: int) -> None:
        self.table = room_table(size, max_steps)
        self.num_envs, self.max_steps = num_envs, max_steps
        self.single_observation_space = gym.spaces.Box(0.0, 1.0, shape=(OBS_DIM,), dtype=np.float32)
        self.single_action_space = gym.spaces.Discrete(N_ACTIONS)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.obs_np = self.table.obs.numpy()
        self.state = np.full(num_envs, self.table.start)
        self.t = np.zeros(num_envs, dtype=np.int64)
        self.ret = np.zeros(num_envs)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        self.state[:] = self.table.start  # the room is deterministic: the seed changes nothing
        self.t[:], self.ret[:] = 0, 0.0
        return self.obs_np[self.state].copy(), {}

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        actions = np.asarray(actions, dtype=np.int64)
        self.t += 1
        nxt = self.table.next_state[self.state, actions]
        terminated = nxt < 0
        reward = np.where(terminated, 1.0 - 0.9 * self.t / self.max_steps, 0.0)
        truncated = self.t >= self.max_steps  # as MiniGrid: also on a goal reached at the last step
        self.ret += reward
        done = terminated | truncated
        info: dict[str, Any] = {}
        if done.any():
            info["final_info"] = {"episode": {"r": self.ret.copy(), "l": self.t.copy()}, "_episode": done.copy()}
        self.state = np.where(done, self.table.start, np.maximum(nxt, 0))
        self.t[done], self.ret[done] = 0, 0.0
        return self.obs_np[self.state].copy(), reward, terminated, truncated, info


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
        return self.actor(obs), self.critic(obs).squeeze(-1)


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

    def check(self, iterations: int) -> None:
        """Raise StabenchError, with one line naming the knob, for any value the task cannot run with."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "onset" and value is None:
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
        if self.onset is not None and not 0 < self.onset < iterations:
            raise StabenchError(f"parallel-staleness: onset {self.onset} must lie strictly inside the run of "
                                f"{iterations} iterations")


class ParallelStalenessRun:
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

    def step(self, injected: bool) -> dict[str, float]:
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
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return {k: float(v) for k, v in row.items()}


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
    # The policy frozen at onset: its exact (DP) return, mean over calibration seeds 0-9 (see the docstring).
    return_floor = 0.182
    return_ceiling = 1.0 - 0.9 * 7 / 30  # the room's optimum, exact: 0.79

    knobs_type = Knobs

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> ParallelStalenessRun:
        budget = self.budget(tier)
        return ParallelStalenessRun(seed, stabilizer, self.diagnostics, self.knobs, budget.onset)

    def grid(self, name: str, tier: str) -> list[dict[str, Any]]:
        """`stabench run --grid staleness`: the map of where stability breaks, one trial per cell."""
        if name != "staleness":
            return super().grid(name, tier)
        return staleness_grid(tier)


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
