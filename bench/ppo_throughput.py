"""PPO training throughput: stabench's trainer against Stable-Baselines3's PPO, side by side, one thread.

Same world (`stabench/EmptyFlat-5x5-v0`: MiniGrid 5x5, flat view, 3 actions), same vectorization (8
envs, SyncVectorEnv / DummyVecEnv), same rollout (32 steps), epochs (4), minibatches (2), same network
(a shared 2 x 64 ReLU trunk with linear policy and value heads). Also measures the cost of diagnostics:
our trainer with the task's diagnostics computed every update (per-layer gradient norms, dormant share)
against the bare trainer. Rounds alternate the contenders so that machine noise hits both alike; the
median of the rounds is reported.

    python bench/ppo_throughput.py [--steps 20480] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn

torch.set_num_threads(1)

ENV_ID = "stabench/EmptyFlat-5x5-v0"
N_ENVS, N_STEPS, EPOCHS, MINIBATCHES, LR, WIDTH = 8, 32, 4, 2, 5e-4, 64


def ours(total_steps: int, diagnostics: bool) -> float:
    from baselines.models import PlainMLP, make_spec
    from baselines.ppo import PPO, PPOConfig
    from suite.api import Stabilizer
    from suite.diagnostics import DIAGNOSTICS
    from tasks.grids import N_ACTIONS, make_vector_env

    torch.manual_seed(0)
    envs = make_vector_env(ENV_ID, N_ENVS)
    model = PlainMLP(make_spec(147, N_ACTIONS, WIDTH, 2))
    cfg = PPOConfig(num_envs=N_ENVS, num_steps=N_STEPS, learning_rate=LR, update_epochs=EPOCHS,
                    num_minibatches=MINIBATCHES, seed=0)
    trainer = PPO(envs, model, cfg, Stabilizer())
    updates = total_steps // (N_ENVS * N_STEPS)
    start = time.perf_counter()
    for _ in range(updates):
        state = trainer.iterate()
        if diagnostics:
            for name in ("grad_norms", "dormant"):
                DIAGNOSTICS[name](state)
    return updates * N_ENVS * N_STEPS / (time.perf_counter() - start)


def sb3(total_steps: int) -> float:
    import gymnasium as gym
    from stable_baselines3 import PPO as SB3PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    import tasks.grids  # noqa: F401  (registers the stabench/ worlds)

    class Trunk(BaseFeaturesExtractor):
        def __init__(self, space: gym.spaces.Box) -> None:
            super().__init__(space, WIDTH)
            self.net = nn.Sequential(nn.Linear(int(np.prod(space.shape)), WIDTH), nn.ReLU(),
                                     nn.Linear(WIDTH, WIDTH), nn.ReLU())

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.net(obs)

    envs = make_vec_env(ENV_ID, n_envs=N_ENVS, seed=0)
    model = SB3PPO("MlpPolicy", envs, n_steps=N_STEPS, batch_size=N_ENVS * N_STEPS // MINIBATCHES, n_epochs=EPOCHS,
                   learning_rate=LR, device="cpu", seed=0, verbose=0,
                   policy_kwargs={"features_extractor_class": Trunk, "net_arch": {"pi": [], "vf": []}})
    start = time.perf_counter()
    model.learn(total_timesteps=total_steps)
    return total_steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20480)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"stabench (diagnostics on)": [], "stabench (diagnostics off)": [],
                                       "Stable-Baselines3": []}
    for r in range(args.rounds):
        results["stabench (diagnostics on)"].append(ours(args.steps, diagnostics=True))
        results["Stable-Baselines3"].append(sb3(args.steps))
        results["stabench (diagnostics off)"].append(ours(args.steps, diagnostics=False))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()),
              flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{args.steps} environment steps per run, {args.rounds} rounds, one thread; median env steps/s:")
    for name, value in med.items():
        print(f"  {name:<28} {value:8.0f}")
    print(f"  ratio stabench (diagnostics on) / Stable-Baselines3: "
          f"{med['stabench (diagnostics on)'] / med['Stable-Baselines3']:.2f}x (target >= 1.5x)")
    slower = 1 - med["stabench (diagnostics on)"] / med["stabench (diagnostics off)"]
    print(f"  cost of diagnostics: {100 * slower:.1f}% slower with them on (target <= 10%)")


if __name__ == "__main__":
    main()
