"""Plumbing tests of the grids family: registered envs, the PPO trainer's hooks, the models, dead-layers runs."""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from gymnasium.utils.env_checker import check_env  # noqa: E402

from baselines.models import MultiSkipResidualMLP, PlainMLP, make_spec  # noqa: E402
from baselines.ppo import PPO, PPOConfig  # noqa: E402
from baselines.stabilizers.grad_clip import GradClip  # noqa: E402
from baselines.stabilizers.multiskip_residual import MultiSkipResidual  # noqa: E402
from suite.api import Stabilizer  # noqa: E402
from suite.diagnostics import DIAGNOSTICS, layer_groups, per_layer_grad_norms  # noqa: E402
from tasks.dead_layers import DeadLayers  # noqa: E402
from tasks.grids import WORLDS, make_vector_env  # noqa: E402

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)

SPEC = make_spec(147, 3, width=64, depth=16)
TINY = PPOConfig(num_envs=2, num_steps=8, update_epochs=2, num_minibatches=2, seed=0)


def same_rows(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a
    )


@pytest.mark.filterwarnings("ignore:.*different from the unwrapped version")
@pytest.mark.parametrize("env_id", sorted(WORLDS))
def test_registered_env_passes_check_env(env_id: str) -> None:
    env = gym.make(env_id)
    check_env(env.unwrapped, skip_render_check=True)  # the bare world
    check_env(env, skip_render_check=True)  # as the trainer sees it
    obs, _ = env.reset(seed=0)
    assert obs.shape == (147,) and obs.dtype == "float32" and 0.0 <= obs.min() and obs.max() <= 1.0
    assert env.action_space == gym.spaces.Discrete(3)


def test_plain_mlp_per_layer_grad_norms_finite_one_per_layer() -> None:
    torch.manual_seed(0)
    model = PlainMLP(SPEC)
    logits, value = model(torch.rand(32, 147))
    (logits.logsumexp(-1).mean() + value.pow(2).mean()).backward()
    norms = per_layer_grad_norms(model)
    assert len(norms) == len(layer_groups(model)) == 16 + 2  # trunk layers + policy and value heads
    assert all(math.isfinite(v) and v > 0 for v in norms.values())
    # He init keeps the first layer's gradient alive through 16 layers (PyTorch's default gives ~1e-8)
    assert list(norms.values())[0] > 1e-4


def test_multiskip_model_has_same_interface() -> None:
    torch.manual_seed(0)
    plain, res = PlainMLP(SPEC), MultiSkipResidualMLP(SPEC)
    x = torch.rand(5, 147)
    for model in (plain, res):
        logits, value = model(x)
        assert logits.shape == (5, 3) and value.shape == (5,)
        assert all(h.shape[0] == 5 and h.shape[1] == 64 for h in model.hidden(x))
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in res.modules())
    assert n_linear == 15 + 2  # 1 input layer + 7 blocks x 2, plus the heads (plain: 16 + 2)


class Counting(Stabilizer):
    name = "counting"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def model(self, model, spec):
        self.calls.append("model")
        assert spec == SPEC
        return model

    def optimizer(self, optimizer, model):
        self.calls.append("optimizer")
        return optimizer

    def advantages(self, advantages, batch):
        self.calls.append("advantages")
        return advantages

    def loss(self, terms, batch):
        self.calls.append("loss")
        assert set(terms) == {"policy", "value", "entropy"}
        return terms

    def after_backward(self, model):
        self.calls.append("after_backward")
        assert all(p.grad is not None for p in model.parameters())


def test_stabilizer_hooks_called_in_order() -> None:
    torch.manual_seed(0)
    stab = Counting()
    ppo = PPO(make_vector_env("stabench/EmptyFlat-5x5-v0", TINY.num_envs), PlainMLP(SPEC), TINY, stab)
    assert stab.calls == ["model", "optimizer"]
    state = ppo.iterate()
    n = TINY.update_epochs * TINY.num_minibatches
    assert stab.calls[2:] == ["advantages", "loss", "after_backward"] * n
    assert state.extras["global_step"] == TINY.num_envs * TINY.num_steps
    assert set(state.grads) == {name for name, _ in ppo.model.named_parameters()}


def test_model_hook_replaces_network_and_clipping_runs() -> None:
    torch.manual_seed(0)
    envs = make_vector_env("stabench/EmptyFlat-5x5-v0", TINY.num_envs)
    ppo = PPO(envs, PlainMLP(SPEC), TINY, MultiSkipResidual())
    assert isinstance(ppo.model, MultiSkipResidualMLP)
    assert ppo.optimizer.param_groups[0]["params"][0] is next(ppo.model.parameters())
    state = ppo.iterate()
    row = DIAGNOSTICS["grad_norms"](state) | DIAGNOSTICS["dormant"](state)
    assert math.isfinite(row["grad_norm_total"]) and 0.0 <= row["dormant_share"] <= 1.0
    ppo = PPO(make_vector_env("stabench/EmptyFlat-5x5-v0", TINY.num_envs), PlainMLP(SPEC), TINY, GradClip())
    ppo.iterate()
    total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ppo.model.parameters()))
    assert total <= GradClip.max_norm + 1e-4  # the grads the optimizer used were clipped


def test_dead_layers_rows_and_deepcopy_branching() -> None:
    task = DeadLayers()
    assert all(name in DIAGNOSTICS for name in task.diagnostics)
    torch.manual_seed(0)
    run = task.build("smoke", 0, Stabilizer())
    row = run.step(False)
    for col in ("step", "return", "entropy", "policy_loss", "value_loss", "grad_norm_total", "dormant_share"):
        assert col in row
    assert row["step"] == 8 * 32
    a, b = copy.deepcopy(run), copy.deepcopy(run)
    for injected in (True, True):
        ra, rb = a.step(injected), b.step(injected)
        assert same_rows(ra, rb)
    assert a.trainer.envs.get_attr("reward_scale") == (1000.0,) * 8
    assert run.trainer.envs.get_attr("reward_scale") == (1.0,) * 8  # the original is untouched
    assert all(r <= task.return_ceiling + 1e-9 for r in (ra["return"],) if math.isfinite(r))  # true, unscaled


def test_same_seed_same_rows() -> None:
    task = DeadLayers()
    rows = []
    for global_seed in (123, 456):
        torch.manual_seed(global_seed)  # the global torch state must not matter: build seeds from `seed`
        run = task.build("smoke", 3, MultiSkipResidual())
        rows.append([run.step(i >= 1) for i in range(2)])
    assert all(same_rows(x, y) for x, y in zip(*rows))


@pytest.mark.smoke
@pytest.mark.parametrize("size,max_steps", [(5, None), (5, 9), (8, 40)])
def test_the_table_driven_room_steps_exactly_as_minigrid(size: int, max_steps: int | None) -> None:
    from minigrid.envs import EmptyEnv

    from tasks.grids import EmptyRoomFlat, flatten_minigrid

    fast = EmptyRoomFlat(size=size, max_steps=max_steps)
    slow = flatten_minigrid(EmptyEnv(size=size, max_steps=max_steps))
    assert np.array_equal(fast.reset(seed=0)[0], slow.reset(seed=0)[0])
    rng, ends = np.random.default_rng(size), {"terminated": 0, "truncated": 0}
    for _ in range(3000):
        action = int(rng.choice(3, p=[0.2, 0.2, 0.6]))
        got, want = fast.step(action), slow.step(action)
        assert np.array_equal(got[0], want[0]) and got[0].dtype == want[0].dtype
        assert got[1] == want[1] and got[2] == want[2] and got[3] == want[3]  # reward bit for bit
        if got[2] or got[3]:
            ends["terminated" if got[2] else "truncated"] += 1
            assert np.array_equal(fast.reset()[0], slow.reset()[0])
    assert ends["terminated"] >= 5 and (max_steps is None or ends["truncated"] >= 5)


def test_the_table_driven_room_renders_as_minigrid() -> None:
    from minigrid.envs import EmptyEnv

    env = gym.make("stabench/EmptyFlat-5x5-v0", render_mode="rgb_array")  # as Stable-Baselines3 builds it
    ref = EmptyEnv(size=5, render_mode="rgb_array")
    env.reset(seed=0)
    ref.reset(seed=0)
    assert np.array_equal(env.render(), ref.render())
    for action in (0, 2, 1, 2, 2, 1, 2, 2):  # into the wall, then along the top row and down onto the goal
        *_, terminated, _, _ = env.step(action)
        ref.step(action)
        assert np.array_equal(env.render(), ref.render())
    assert terminated
    env.close()


def test_the_table_driven_room_rejects_bad_steps() -> None:
    from tasks.grids import EmptyRoomFlat

    with pytest.raises(ValueError, match="render_mode 'ansi' is not one of"):
        EmptyRoomFlat(size=5, render_mode="ansi")
    env = EmptyRoomFlat(size=5)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="not one of the room's 3 actions"):
        env.step(3)
    for action in (2, 2, 1, 2, 2):  # forward, forward, turn right, forward, forward: onto the goal
        *_, terminated, _, _ = env.step(action)
    assert terminated
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(0)


def test_upper_quantile_is_torch_quantile_bit_for_bit() -> None:
    from baselines.ppo import upper_quantile

    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 100, 128, 257):
        for x in (torch.rand(n, generator=g), torch.randn(n, generator=g).exp(),
                  torch.randint(0, 3, (n,), generator=g).float(), torch.ones(n), torch.rand(n, generator=g).double()):
            for q in (0.0, 0.5, 0.9, 0.99, 1.0):
                assert torch.equal(upper_quantile(x, q), torch.quantile(x, q)), (n, q)
