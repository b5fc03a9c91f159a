"""PPO training throughput: stabench's trainer against Stable-Baselines3's PPO, side by side, one thread.

Same world (`stabench/EmptyFlat-5x5-v0`: MiniGrid 5x5, flat view, 3 actions; Stable-Baselines3's
`make_vec_env` builds it with `render_mode="rgb_array"`, the same class), 8 envs each (ours steps them together
in numpy, `RoomVectorEnv`, with the same numbers as a SyncVectorEnv of the single rooms; Stable-Baselines3 steps
the single rooms in its DummyVecEnv), same rollout (32 steps), epochs (4), minibatches (2), same network (a shared
2 x 64 ReLU trunk with linear policy and value heads). Also measures the cost of diagnostics: our trainer
with the task's diagnostics computed every update (per-layer gradient norms, dormant share) against the
bare trainer.

The three contenders are built once and then take turns, `--chunk` updates (x 256 env steps) each, for
`--rounds` rounds in rotating order, so that the machine's speed, which drifts by tens of percent over
seconds on a shared host, hits all three alike. Reported: the median throughput of each, and the median
and range of the per-round ratios (each taken between chunks run seconds apart).

    python bench/ppo_throughput.py [--chunk 8] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

torch.set_num_threads(1)

ENV_ID = "stabench/EmptyFlat-5x5-v0"
N_ENVS, N_STEPS, EPOCHS, MINIBATCHES, LR, WIDTH = 8, 32, 4, 2, 5e-4, 64
UPDATE = N_ENVS * N_STEPS  # env steps per update


def ours(diagnostics: bool) -> Callable[[int], None]:
    """Our PPO; the returned function runs that many updates (with the task's diagnostics, if asked)."""
    from stabench.baselines.models import PlainMLP, make_spec
    from stabench.baselines.ppo import PPO, PPOConfig
    from stabench.suite.api import Stabilizer
    from stabench.suite.diagnostics import DIAGNOSTICS
    from stabench.tasks.worlds.grids import N_ACTIONS, make_vector_env

    torch.manual_seed(0)
    envs = make_vector_env(ENV_ID, N_ENVS)
    model = PlainMLP(make_spec(147, N_ACTIONS, WIDTH, 2))
    cfg = PPOConfig(num_envs=N_ENVS, num_steps=N_STEPS, learning_rate=LR, update_epochs=EPOCHS,
                    num_minibatches=MINIBATCHES, seed=0)
    trainer = PPO(envs, model, cfg, Stabilizer())

    def run(updates: int) -> None:
        for _ in range(updates):
            state = trainer.iterate()
            if diagnostics:
                for name in ("grad_norms", "dormant"):
                    DIAGNOSTICS[name](state)

    return run


def sb3() -> Callable[[int], None]:
    """Stable-Baselines3's PPO; the returned function continues `learn` for that many updates."""
    import gymnasium as gym
    import stabench.tasks.worlds.grids  # noqa: F401  (registers the stabench/ worlds)
    from stable_baselines3 import PPO as SB3PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    class Trunk(BaseFeaturesExtractor):
        def __init__(self, space: gym.spaces.Box) -> None:
            super().__init__(space, WIDTH)
            self.net = nn.Sequential(nn.Linear(int(np.prod(space.shape)), WIDTH), nn.ReLU(),
                                     nn.Linear(WIDTH, WIDTH), nn.ReLU())

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.net(obs)

    envs = make_vec_env(ENV_ID, n_envs=N_ENVS, seed=0)
    model = SB3PPO("MlpPolicy", envs, n_steps=N_STEPS, batch_size=UPDATE // MINIBATCHES, n_epochs=EPOCHS,
                   learning_rate=LR, device="cpu", seed=0, verbose=0,
                   policy_kwargs={"features_extractor_class": Trunk, "net_arch": {"pi": [], "vf": []}})
    def run(updates: int) -> None:  # the first call resets the envs itself (no last observation yet)
        model.learn(total_timesteps=updates * UPDATE, reset_num_timesteps=False)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunk", type=int, default=8, help="updates per turn (default: 8, 2,048 env steps)")
    parser.add_argument("--rounds", type=int, default=15, help="turns of each contender (default: 15)")
    args = parser.parse_args()
    if args.chunk < 1 or args.rounds < 1:
        parser.error("--chunk and --rounds must be at least 1")
    contenders = {"stabench (diagnostics on)": ours(True), "Stable-Baselines3": sb3(),
                  "stabench (diagnostics off)": ours(False)}
    for run in contenders.values():  # warm-up: first-call costs (imports, allocator) are not throughput
        run(2)
    names = list(contenders)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            start = time.perf_counter()
            contenders[name](args.chunk)
            rates[name].append(args.chunk * UPDATE / (time.perf_counter() - start))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()), flush=True)
    ratio = [a / b for a, b in zip(rates["stabench (diagnostics on)"], rates["Stable-Baselines3"])]
    cost = [1 - a / b for a, b in zip(rates["stabench (diagnostics on)"], rates["stabench (diagnostics off)"])]
    print(f"\n{args.rounds} rounds of {args.chunk * UPDATE} env steps per contender, one thread; median env steps/s:")
    for name, values in rates.items():
        print(f"  {name:<28} {statistics.median(values):8.0f}")
    print(f"  ratio stabench (diagnostics on) / Stable-Baselines3, per round: median {statistics.median(ratio):.2f}x "
          f"(range {min(ratio):.2f}-{max(ratio):.2f}; target >= 2x)")
    print(f"  cost of diagnostics, per round: median {100 * statistics.median(cost):.1f}% slower with them on "
          f"(range {100 * min(cost):.1f} to {100 * max(cost):.1f}; target <= 10%)")


if __name__ == "__main__":
    main()
