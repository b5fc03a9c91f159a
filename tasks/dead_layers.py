"""dead-layers: a reward-scale shock, while the goal moves, stops a deep plain actor-critic from re-learning.

Named after the deep-network pathology studied by Creus Castanyer et al. (2025, "Stable gradients for
stable learning at scale in deep reinforcement learning"): gradients that degrade with depth in deep plain
networks under non-stationary targets, fixed there by a multi-skip residual architecture. The setting is
that paper's question at toy scale; the mechanism we MEASURE is not dead layers (see below).

Version 2 (issue 12, "not learning must not win"). In version 1 the room never changed, so the policy frozen
at onset already solved it and a learner that stopped learning nearly won. Now the room changes at onset in
BOTH branches and the post-onset phase is a new problem the onset policy cannot solve.

Setting (everything the task fixes lives in this file):
- Healthy phase: `stabench/EmptyFlat-5x5-v0` (MiniGrid's empty 5x5 room, flat 147-dim view / 10, 3 actions;
  start top-left facing right, goal in the bottom-right corner (3, 3), 100-step timeout).
- At onset, in both branches, the room changes (each env at its next reset, `EmptyRoomFlat.change_room`):
  the goal moves to the centre cell (2, 2), visible in the view as before, and episodes time out after 20
  steps (reward 1 - 0.9 t / 20). Neither shortest path of the old room (top row then right column, or left
  column then bottom row) passes the centre, so the onset policy's habit earns nothing there (tested).
- Trainer: PPO (baselines/ppo.py), 8 envs x 32 steps per update, 2 epochs x 2 minibatches, Adam lr 5e-4
  eps 1e-5, gamma 0.99, lambda 0.95, clip 0.2, entropy 0.01, value coefficient 0.5, per-minibatch advantage
  normalization, no gradient clipping.
- Network: a plain MLP of 16 Linear+ReLU layers of width 64 (He-normal, zero biases), one trunk shared by a
  policy head and a value head (baselines/models.py).
- Injection: from the first injected iteration on, the reward the learner sees is multiplied by 1000 (a
  `RewardScale` wrapper above the episode statistics: the row's `return` stays the true return). The
  control branch never scales; it gets the same new room.
- Ground truth: the run fails if the mean true return over the last third of the run (updates 37-54 at
  the quick tier) is below 0.5, which neither the uniform policy (exact 0.169) nor any onset policy of
  seeds 0-9 (exact 0.04-0.26) comes near; the control re-learns to 0.76-0.86.
- Anchors: `return_ceiling` = the new room's exact optimum, 1 - 0.9 * 3/20 = 0.865 (forward, turn right,
  forward). `return_floor` = 0.147: the exact expected return in the new room of the baseline's policy
  frozen at onset (dynamic programming over the room's table, `RoomTable.evaluate`), per seed 0.147 0.131
  0.075 0.164 0.256 0.130 0.042 0.249 0.164 0.115 on seeds 0-9, their mean fixed as a number.
- Matched fix: `multiskip-residual` = the multi-skip residual trunk (LayerNorm in every block) plus a critic
  loss divided by max(1, mean squared return target) (baselines/stabilizers/multiskip_residual.py). Named
  non-fix: global gradient-norm clipping at 0.5.

Mechanism, as measured:
- Version 1 (same shock, same network; quick tier seeds 0-4, not re-measured for v2): the value loss, in
  units of 1000x returns, dominates the gradient in EVERY trunk layer (value/policy gradient-norm ratio 2e3
  to 4e6 per layer on the first injected update); Adam normalizes step sizes, so the whole trunk moves at
  full speed in the value loss's direction; the trunk's output norm on a held batch jumps 4-19x in that one
  update and the policy logits, a linear readout of the same features, blow up with it: the policy
  saturates (held-batch entropy 0.00-0.26 after one update). Dead ReLU units rise too, but the residual fix
  ends with more of them and still learns: the measured mechanism is critic-driven policy saturation
  through the shared trunk, not dead layers. Multiplying the value term by 1e-6 after onset let 4/5
  baseline seeds keep their return.
- Version 2 (quick tier, seeds 0-9, baseline): the same first step, then no re-learning. Total gradient norm
  on the first injected update 885-5604 (control 0.5-2.7), median over the post-onset updates 1653-7535
  (control 0.7-2.5). The policy saturates at once: rollout entropy over updates 21-23 0.00-0.23 (control
  0.63-1.02, exploring the new room). It never finds the centre reliably: tail return 0.14-0.31 (control
  0.35-0.86); in the tail the entropy drifts back to 0.56-0.68 while the control, having learned, sits at
  0.00-0.63. Dead ReLU units (share never active on the held batch) 0.52-0.57 vs 0.37-0.48 in the control,
  0.28-0.36 for the fix in either branch: more dead units go with the failure here, but v1's fix learned
  with more of them, so we do not claim they cause it. Name as measured: the critic's 1000x loss takes the
  shared trunk; the policy first saturates, then stays unlearned.
- Fix, as measured: the residual trunk with LayerNorm ALONE no longer suffices once the policy must
  re-learn: it kept the policy from saturating in v1, but in v2 (4 epochs, 45 updates) it learned the moved
  goal on no seed of ten under the shock (tail 0.24-0.38; control 0.71-0.86). A value head kept off the trunk by a
  stop-gradient did learn under the shock (0/10 failed) but failed its own control 9/10 and the healthy
  phase on 3/10 seeds: rejected. Dividing the critic loss by the return scale removes the 1000^2 factor
  from the trunk's gradient and leaves returns of at most 1 (the control, the healthy phase) untouched;
  with it the fix re-learns under the shock on every seed. What the residual part adds is measured on the
  control: the residual control relearns on 10/10 seeds (tail 0.76-0.86), the plain one on 9/10 with a
  slower climb. The plain net with only the loss division was not run.
- Why clipping does not fix it: it shortens the gradient but keeps its direction, which the value loss
  sets, and Adam rescales the length anyway.

Calibration (quick: 55 updates, onset 20, seeds 0-9; failed = tail mean below 0.5; normalized return = mean
post-onset return between floor and ceiling; 2-core AMD EPYC, shared, 2026-11-23;
results/calibration/dead-layers/seeds-0-9 and seeds-100-109):
Failed = injected runs failed; ctl = control runs failed; norm. = normalized return [95% CI]; ctl n. = the
control's normalized return.
| method | 0-9 failed | ctl | norm. | ctl n. | 100-109 failed | ctl | norm. | ctl n. |
|---|---|---|---|---|---|---|---|---|
| baseline | 10/10 | 1/10 | 0.045 [0.012, 0.075] | 0.62 | 10/10 | 2/10 | 0.073 [0.026, 0.107] | 0.61 |
| multiskip-residual | 0/10 | 0/10 | 0.746 [0.706, 0.789] | 0.67 | 0/10 | 0/10 | 0.679 [0.542, 0.791] | 0.63 |
| grad-clip | 10/10 | 0/10 | -0.101 [-0.107, -0.095] | 0.67 | not run | | | |
| frozen-at-onset | 10/10 | 10/10 | 0.014 [-0.043, 0.072] | 0.01 | 10/10 | 10/10 | 0.019 [-0.021, 0.058] | 0.02 |
| no-update | 10/10 | 10/10 | 0.031 [0.026, 0.036] | 0.03 | 10/10 | 10/10 | 0.030 [0.018, 0.043] | 0.03 |
Tail returns, seeds 0-9: baseline injected 0.14-0.31, control 0.35 0.67-0.86; fix injected 0.77-0.86, control
0.76-0.86. Seeds 100-109: baseline injected 0.09-0.28, control 0.21 0.26 0.63-0.86; fix injected 0.61-0.86,
control 0.66-0.86; frozen-at-onset 0.07-0.21, no-update 0.14-0.20.
Settings chosen on seeds 0-9 only (goal cell, 20-step timeout, 2 epochs, 55 updates; 4 epochs, 45 updates,
entropy 0.03, lr 3e-4 or 1e-3, onset 15 and a 30-step timeout were tried and gave more control failures or a
slower climb). The bar is met on both
seed sets except by the baseline's control: its normalized return is 0.62 (0-9) and 0.61 (100-109), below
0.8, because the plain net takes 10-20 updates to re-learn the moved goal and normalized return averages
the whole post-onset phase against the exact optimum; and it fails 2/10 on seeds 100-109 (the plain deep
net's spontaneous collapse without any shock, as in v1: a run at 0.85 drops to 0 within one update). Hence
`experimental = True`. A ceiling measured on the control would lift its normalized return to about 1 by
construction; not done (the ceiling is the exact optimum, as asked).
One thread: 2.3-4.7 s per (method, seed) at quick on the quieter run of seeds 100-109 (baseline 4.7, fix 4.1),
5-14 s on the loaded run of seeds 0-9 (v1: 4.5-9 s). The full tier (110 updates, onset 40) was not re-calibrated for v2.
Detector (chosen ONLY on seeds 100-109): total gradient norm above 100. On those runs every healthy and
control update of every method stays at or below 30, and every baseline first injected update is 1882-5580.

Suite 0.3.0 re-measured seeds 0-9 and 100-109: every return of every method equals 0.2.0's bit for bit
(`multiskip-residual` and `grad-clip` now live in `architecture.py` and `clipping.py`); verdict unchanged.
"""

from __future__ import annotations

import torch
from stabench.baselines.models import PlainMLP, make_spec
from stabench.baselines.ppo import PPO, PPOConfig
from stabench.suite.api import Budget, DetectorSpec, GroundTruth, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.grids import N_ACTIONS, make_vector_env, room_table

ENV_ID = "stabench/EmptyFlat-5x5-v0"
SIZE = 5
OBS_DIM = 147  # 7 x 7 x 3 egocentric view, flattened
WIDTH, DEPTH = 64, 16
REWARD_SCALE = 1000.0  # the injection: reward x 1000 from the first injected iteration on
NEW_GOAL = (2, 2)  # from onset on, in both branches, the goal stands in the centre of the room ...
NEW_MAX_STEPS = 20  # ... and episodes time out after 20 steps
ENT_COEF = 0.01
LEARNING_RATE = 5e-4
EPOCHS, CLIP = 2, 0.2


def ppo_config(seed: int) -> PPOConfig:
    return PPOConfig(num_envs=8, num_steps=32, learning_rate=LEARNING_RATE, adam_eps=1e-5, gamma=0.99, gae_lambda=0.95,
                     update_epochs=EPOCHS, num_minibatches=2, clip_coef=CLIP, ent_coef=ENT_COEF, vf_coef=0.5, seed=seed)


def new_room():
    """The post-onset room's table (goal in the centre, 20-step timeout): exact returns of any policy."""
    return room_table(SIZE, NEW_MAX_STEPS, NEW_GOAL)


class DeadLayersRun:
    """One seed: the vector env, the network, Adam and the sampling generator all live in `self.trainer`."""

    def __init__(self, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...], onset: int) -> None:
        cfg = ppo_config(seed)
        envs = make_vector_env(ENV_ID, cfg.num_envs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = PlainMLP(make_spec(OBS_DIM, N_ACTIONS, WIDTH, DEPTH))
            self.trainer = PPO(envs, model, cfg, stabilizer)  # the stabilizer may rebuild the model here
        self.diagnostics = diagnostics
        self.onset = onset
        self.iteration = 0
        self.injected = False

    def step(self, injected: bool) -> dict[str, float]:
        if self.iteration == self.onset:  # both branches: the room changes (each env at its next reset)
            self.trainer.envs.call("change_room", NEW_GOAL, NEW_MAX_STEPS)
        if injected and not self.injected:
            self.injected = True
            self.trainer.envs.set_attr("reward_scale", REWARD_SCALE)
        self.iteration += 1
        state = self.trainer.iterate()
        row = {
            "step": float(state.extras["global_step"]),
            "return": state.extras["episode_return"],
            "episodes": float(state.extras["episodes"]),
            "entropy": state.losses["entropy"],
            "policy_loss": state.losses["policy_loss"],
            "value_loss": state.losses["value_loss"],
            "approx_kl": state.losses["approx_kl"],
            "clip_frac": state.losses["clip_frac"],
        }
        for name in self.diagnostics:
            row.update(DIAGNOSTICS[name](state))
        return {k: float(v) for k, v in row.items()}


class DeadLayers(Task):
    id = "dead-layers"
    family = "grids"
    version = "2"
    experimental = True  # the baseline's control misses the bar's 0.8 normalized return (0.62): see the docstring
    trainer = "ppo"
    budgets = {
        "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=55, onset=20, seeds=5),
        "full": Budget(iterations=110, onset=40, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=0.5, fails_when="below", reduce="tail_mean", tail=1 / 3)
    matched_fix = "multiskip-residual"
    methods = ("baseline", "multiskip-residual", "grad-clip")
    detector = DetectorSpec(metric="grad_norm_total", threshold=100.0)
    diagnostics = ("grad_norms", "dormant")
    return_floor = 0.147  # exact post-onset return of the baseline policy frozen at onset, mean over seeds 0-9
    return_ceiling = room_table(SIZE, NEW_MAX_STEPS, NEW_GOAL).optimal_return()

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> DeadLayersRun:
        budget = self.budget(tier)  # validates the tier
        return DeadLayersRun(seed, stabilizer, self.diagnostics, budget.onset)
