"""dead-layers: a reward-scale shock saturates the policy of a deep plain actor-critic through its shared trunk.

Named after the deep-network pathology studied by Creus Castanyer et al. (2025, "Stable gradients for
stable learning at scale in deep reinforcement learning"): gradients that degrade with depth in deep plain
networks under non-stationary targets, fixed there by a multi-skip residual architecture. The setting is
that paper's question at toy scale; the mechanism we MEASURE is not dead layers (see below).

Setting (everything the task fixes lives in this file):
- World: `stabench/EmptyFlat-5x5-v0` (MiniGrid's empty 5x5 room, flat 147-dim view / 10, 3 actions; start
  top-left facing right, goal bottom-right, 100-step timeout); optimum return 1 - 0.9 * 5/100 = 0.955.
- Trainer: PPO (baselines/ppo.py), 8 envs x 32 steps per update, 4 epochs x 2 minibatches, Adam lr 5e-4
  eps 1e-5, gamma 0.99, lambda 0.95, clip 0.2, entropy 0.01, value coefficient 0.5, per-minibatch advantage
  normalization, no gradient clipping.
- Network: a plain MLP of 16 Linear+ReLU layers of width 64 (He-normal, zero biases), one trunk shared by a
  policy head and a value head (baselines/models.py).
- Injection: from the first injected iteration on, the reward the learner sees is multiplied by 1000 (a
  `RewardScale` wrapper above the episode statistics: the row's `return` stays the true return). The
  control branch never scales.
- Ground truth: the run fails if the mean true return over the last third of the run (updates 30-44 at
  the quick tier) is below 0.5. Matched fix: the multi-skip residual trunk. Named non-fix: global
  gradient-norm clipping at 0.5.

Mechanism, as measured (quick tier, seeds 0-4, first injected update = update 20):
- The value loss, now in units of 1000x returns, dominates the gradient in EVERY trunk layer (value/policy
  gradient-norm ratio 2e3 to 4e6 per layer on the first injected update); Adam normalizes step sizes, so the
  whole trunk moves at full speed in the value loss's direction. The trunk's output norm on a held batch
  jumps 4-19x within that one update (25->403, 3.5->67, 21->373, 7->233, 28->423), and the policy logits,
  a linear readout of the same features, blow up with it (held-batch logit range after update 20: 63 4.5
  47 33 63 injected vs 5.5 0.7 3.7 1.4 6.7 control): the policy saturates (held-batch entropy 0.26 0.26 0.00
  0.00 0.00 after that one update; 0.00-0.40 in the tail vs 0.03-0.76 in the control).
- The near-deterministic policy stops exploring: returns fall to 0 within a few updates; some seeds partly
  recover and relapse, and over 80 post-onset updates (100-update runs) none returns to the control's
  0.955 (tail means 0.00 0.32 0.15 0.51 0.00). Total gradient norm: median 0.5-2 (max 64) over 60
  healthy/control runs, 2e2-3e5 on the first injected update, 1e1-1e4 after.
- Not dead layers: dead ReLU units do rise (share of units never active on the held batch 0.53-0.56
  injected vs 0.36-0.47 control), but the residual fix ends with MORE dead units (0.60-0.64) and still
  learns; the dormant share behaves the same way. Per-layer policy gradients are no clean separator either:
  in seeds 0-1 they fall 20-1000x below the control's uniformly over depth, in seeds 2-3 they are larger.
- Causal check: multiplying the value term of the loss by 1e-6 after onset (undoing the 1000^2 in the
  squared error) lets 4/5 baseline seeds keep their return (tail 0.94 0.77 0.00 0.95 0.95).
- Why the fix works: LayerNorm bounds every block's output, so the residual trunk's feature norm grows only
  1.2-1.4x in the first injected update (43->59), the logit range stays 1.9-4.2 (3-12 in the tail) and the
  held-batch entropy 0.4-0.7 in the tail. Why clipping does not: it shortens the gradient but keeps its
  direction, which the value loss sets, and Adam rescales the length anyway.

Calibration (quick: 45 updates, onset 20; tail-mean true return, seeds 0-4; failed = below 0.5; PPO with
fused Adam, 2-core AMD EPYC, 2026-11-23; results/quick):
| method | injected | failed | control | control failed |
|---|---|---|---|---|
| baseline | 0.20 0.42 0.19 0.32 0.03 | 5/5 (10/10 on seeds 0-9, full tier) | 0.95 0.93 0.00 0.95 0.65 | 1/5 (2/10) |
| multiskip-residual | 0.76 0.85 0.85 0.76 0.82 | 0/5 (0/10) | 0.95 0.94 0.95 0.95 0.95 | 0/5 (1/10) |
| grad-clip | 0.15 0.15 0.41 0.29 0.12 | 5/5 (8/10) | 0.92 0.95 0.95 0.95 0.45 | 1/5 (4/10) |
The control sits on the bar: plain PPO on a 16-layer plain net collapses without any shock on some seeds
(healthy-phase collapse, as in seed 2 above), and which seeds do moves with float rounding (another CPU,
another Adam kernel). The mechanism's figures above were measured with the foreach Adam on an Intel
Xeon; the fused kernel moves them slightly, not their pattern. Full (90 updates, onset 40, seeds 0-9):
the numbers in brackets. One thread: 4.5-9 s per (method, seed) at quick (healthy phase plus both
branches), 9-13 s at full. The detector threshold (total gradient norm 100) lies above every healthy or
control value seen (max 64) and below every first injected update with a rewarded batch (min 217).
"""

from __future__ import annotations

import torch

from baselines.models import PlainMLP, make_spec
from baselines.ppo import PPO, PPOConfig
from suite.api import Budget, DetectorSpec, GroundTruth, Stabilizer, Task
from suite.diagnostics import DIAGNOSTICS
from tasks.grids import N_ACTIONS, make_vector_env, optimal_return_empty

ENV_ID = "stabench/EmptyFlat-5x5-v0"
OBS_DIM = 147  # 7 x 7 x 3 egocentric view, flattened
WIDTH, DEPTH = 64, 16
REWARD_SCALE = 1000.0  # the injection: reward x 1000 from the first injected iteration on


def ppo_config(seed: int) -> PPOConfig:
    return PPOConfig(num_envs=8, num_steps=32, learning_rate=5e-4, adam_eps=1e-5, gamma=0.99, gae_lambda=0.95,
                     update_epochs=4, num_minibatches=2, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, seed=seed)


class DeadLayersRun:
    """One seed: the vector env, the network, Adam and the sampling generator all live in `self.trainer`."""

    def __init__(self, seed: int, stabilizer: Stabilizer, diagnostics: tuple[str, ...]) -> None:
        cfg = ppo_config(seed)
        envs = make_vector_env(ENV_ID, cfg.num_envs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = PlainMLP(make_spec(OBS_DIM, N_ACTIONS, WIDTH, DEPTH))
            self.trainer = PPO(envs, model, cfg, stabilizer)  # the stabilizer may rebuild the model here
        self.diagnostics = diagnostics
        self.injected = False

    def step(self, injected: bool) -> dict[str, float]:
        if injected and not self.injected:
            self.injected = True
            self.trainer.envs.set_attr("reward_scale", REWARD_SCALE)
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
    trainer = "ppo"
    budgets = {
        "smoke": Budget(iterations=4, onset=2, seeds=1, report_every=1),
        "quick": Budget(iterations=45, onset=20, seeds=5),
        "full": Budget(iterations=90, onset=40, seeds=10),
    }
    ground_truth = GroundTruth(metric="return", threshold=0.5, fails_when="below", reduce="tail_mean", tail=1 / 3)
    matched_fix = "multiskip-residual"
    methods = ("baseline", "multiskip-residual", "grad-clip")
    detector = DetectorSpec(metric="grad_norm_total", threshold=100.0)
    diagnostics = ("grad_norms", "dormant")
    return_floor = 0.0
    return_ceiling = optimal_return_empty(5)
    # The policy saturates on the first injected update and returns fall within a few: 5 of 25 updates.
    detection_window = 0.2

    def build(self, tier: str, seed: int, stabilizer: Stabilizer) -> DeadLayersRun:
        self.budget(tier)  # validates the tier
        return DeadLayersRun(seed, stabilizer, self.diagnostics)

