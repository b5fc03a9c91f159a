"""dead-layers: a reward-scale shock, while the goal moves, stops a deep plain actor-critic from re-learning.

Named after the deep-network pathology studied by Creus Castanyer et al. (2025, "Stable gradients for
stable learning at scale in deep reinforcement learning"): gradients that degrade with depth in deep plain
networks under non-stationary targets, fixed there by a multi-skip residual architecture. The setting is
that paper's question at toy scale; the mechanism we measure is not dead layers (see below).

Setting (everything the task fixes lives in this file):
- Healthy phase: `stabench/EmptyFlat-5x5-v0` (MiniGrid's empty 5x5 room, flat 147-dim view / 10, 3 actions;
  start top-left facing right, goal in the bottom-right corner (3, 3), 100-step timeout).
- At onset, in both branches, the room changes (each env at its next reset, `EmptyRoomFlat.change_room`):
  the goal moves to the centre cell (2, 2), visible in the view as before, and episodes time out after 20
  steps (reward 1 - 0.9 t / 20). Neither shortest path of the old room (top row then right column, or left
  column then bottom row) passes the centre, so the onset policy's habit earns nothing there (tested), and the
  post-onset phase is a new problem in both branches: a learner that stops learning at onset cannot win.
- Trainer: PPO (baselines/ppo.py), 8 envs x 32 steps per update, 2 epochs x 2 minibatches, Adam lr 5e-4
  eps 1e-5, gamma 0.99, lambda 0.95, clip 0.2, entropy 0.01, value coefficient 0.5, per-minibatch advantage
  normalization, no gradient clipping.
- Network: a plain MLP of 16 Linear+ReLU layers of width 64 (He-normal, zero biases), one trunk shared by a
  policy head and a value head (baselines/models.py).
- Injection: from the first injected iteration on, the reward the learner sees is multiplied by 1000 (a
  `RewardScale` wrapper above the episode statistics: the row's `return` stays the true return). The
  control branch never scales; it gets the same new room.
- Ground truth: the run fails if the mean true return over the last third of the run (updates 37-54 at
  the quick tier) is below 0.5, well above the uniform policy's exact 0.169 and the exact return of the
  policy frozen at onset on the calibration seeds.
- Anchors: `return_ceiling` = the new room's exact optimum, 1 - 0.9 * 3/20 = 0.865 (forward, turn right,
  forward). `return_floor` = the exact expected return in the new room of the baseline's policy frozen at
  onset (dynamic programming over the room's table, `RoomTable.evaluate`), its mean over seeds 0-9 fixed as a
  number.
- Matched fix: `multiskip-residual` = the multi-skip residual trunk (LayerNorm in every block) plus a critic
  loss divided by max(1, mean squared return target) (baselines/stabilizers/architecture.py). Named non-fix:
  `grad-clip`, global gradient-norm clipping at 0.5.
- Chosen on seeds 0-9 (the goal cell, the 20-step timeout, 2 epochs, 55 updates, against more epochs, other
  learning rates and entropy coefficients, an earlier onset and a longer timeout); the detector, total
  gradient norm above 100, on seeds 100-109 only.

Mechanism, as measured:
- The value loss, in units of 1000x returns, dominates the gradient in every trunk layer on the first
  injected update; Adam normalizes step sizes, so the whole trunk moves at full speed in the value loss's
  direction, the trunk's output norm jumps, and the policy logits, a linear readout of the same features,
  blow up with it: the policy saturates at once, then never re-learns the moved goal. Name as measured: the
  critic's 1000x loss takes the shared trunk; the policy first saturates, then stays unlearned.
- Dead ReLU units rise with the failure, but a residual trunk that kept the policy learning ended with more
  of them than the plain one, so we do not claim they cause it.
- Fix: the residual trunk with LayerNorm alone does not suffice once the policy must re-learn. A value head
  kept off the trunk by a stop-gradient learned under the shock but failed its own control and the healthy
  phase: rejected. Dividing the critic loss by the return scale removes the 1000^2 factor from the trunk's
  gradient and leaves returns of at most 1 (the control, the healthy phase) untouched; with it the fix
  re-learns under the shock. The residual part speeds the control's re-learning; the plain net with only the
  loss division was not run.
- Why clipping does not fix it: it shortens the gradient but keeps its direction, which the value loss
  sets, and Adam rescales the length anyway.

Experimental: the baseline's control misses the bar's 0.8 normalized return, because the plain net takes
many updates to re-learn the moved goal and normalized return averages the whole post-onset phase against the
exact optimum, and the plain deep net occasionally collapses without any shock. A ceiling measured on the
control would lift its normalized return to about 1 by construction; not done (the ceiling is the exact
optimum). The full tier (110 updates, onset 40) is not calibrated. Measured numbers, per seed set:
results/calibration.md (runs in results/calibration/dead-layers/).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from stabench.baselines.models import PlainMLP, make_spec
from stabench.baselines.ppo import PPO, PPOConfig
from stabench.suite.api import Budget, DetectorSpec, Figure, GroundTruth, Stabilizer, Task
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.suite.figures import need, save
from stabench.tasks.worlds.grids import N_ACTIONS, make_vector_env, room_table

if TYPE_CHECKING:
    import pandas as pd

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


def draw_grad_heatmap(table: pd.DataFrame, out: Path) -> list[Path]:
    """Per-layer gradient norm (layer x iteration), the baseline's lowest seed, control beside injected."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    rows = need(table, "dead-layers", "grad_norm_total")
    rows = rows[(rows["method"] == "baseline") & (rows["seed"] == rows["seed"].min())]
    layers = sorted(c for c in rows.columns if c.startswith("grad_norm/") and rows[c].notna().any())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, variant in zip(axes, ("control", "injected")):
        mine = rows[rows["variant"] == variant].set_index("iteration")[layers]
        data = np.log10(mine.T.clip(lower=1e-8))
        sns.heatmap(data, ax=ax, cmap="magma", vmin=-4, vmax=5,
                    cbar_kws={"label": "log10 gradient norm"}, xticklabels=5)
        onset = int(rows["onset_iteration"].iloc[0])
        ax.axvline(onset, color="white", linestyle="--", linewidth=1.2)
        ax.set_title(f"{variant}: onset (dashed) at iteration {onset}")
        ax.set_xlabel("iteration")
    axes[0].set_ylabel("layer (input to output)")
    axes[0].set_yticklabels([c.split("/")[1] for c in layers], rotation=0)
    return save(fig, out, "03_layer_gradient_heatmap")


class DeadLayers(Task):
    id = "dead-layers"
    family = "grids"
    version = "2"
    experimental = True  # the baseline's control misses the bar's 0.8 normalized return: see the docstring
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
    # The empty rooms of the PPO grid tasks (`worlds.grids.WORLDS`): this task trains on the 5x5 one.
    environments = {
        "stabench/EmptyFlat-5x5-v0": ("stabench.tasks.worlds.grids:make_empty_flat", {"size": 5}),
        "stabench/EmptyFlat-8x8-v0": ("stabench.tasks.worlds.grids:make_empty_flat", {"size": 8}),
    }
    figures = (
        Figure("03_layer_gradient_heatmap", "per-layer gradient heatmap",
               "Per-layer gradient norms of the 16-layer plain network, control beside injected run.",
               draw_grad_heatmap),
    )
    paper = (
        "On dead-layers a deep plain actor-critic (16 ReLU layers, one trunk shared by the policy and the value "
        "head) must find a goal that moves at onset in both branches, while the injected branch sees its reward "
        "multiplied by 1000. The value loss, in units of the scaled returns, then dominates the gradient in "
        "every layer of the shared trunk; Adam moves the whole trunk at full speed in its direction, the policy "
        "logits, a linear readout of the same features, blow up, and the policy saturates at once and never "
        "re-learns the moved goal. What the task measures is this critic-driven saturation through the shared "
        "trunk, not dead layers: dead ReLU units rise with the failure, but a residual trunk that kept learning "
        "ended with more of them. Gradient clipping shortens the gradient but keeps the direction the value "
        "loss sets; the multi-skip residual trunk with a critic loss divided by the return scale re-learns "
        "under the shock. The figure shows the per-layer gradient norms of one baseline run, control beside "
        "injected."
    )

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> DeadLayersRun:
        budget = self.budget(tier)  # validates the tier
        return DeadLayersRun(seed, stabilizer, self.diagnostics, budget.onset)
