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
from stabench.baselines.models import MultiSkipResidualMLP, PlainMLP, make_spec  # noqa: E402
from stabench.baselines.ppo import PPO, PPOConfig  # noqa: E402
from stabench.baselines.stabilizers.architecture import MultiSkipResidual  # noqa: E402
from stabench.baselines.stabilizers.clipping import GradClip  # noqa: E402
from stabench.suite.api import Stabilizer  # noqa: E402
from stabench.suite.diagnostics import DIAGNOSTICS, layer_groups, per_layer_grad_norms  # noqa: E402
from stabench.tasks.dead_layers import NEW_GOAL, NEW_MAX_STEPS, DeadLayers, new_room  # noqa: E402
from stabench.tasks.worlds.grids import environments, make_vector_env  # noqa: E402

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)

SPEC = make_spec(147, 3, width=64, depth=16)
TINY = PPOConfig(num_envs=2, num_steps=8, update_epochs=2, num_minibatches=2, seed=0)


def same_rows(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a
    )


@pytest.mark.filterwarnings("ignore:.*different from the unwrapped version")
@pytest.mark.parametrize("env_id", sorted(environments))
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
    # `advantages` once per iteration on the whole rollout, then per minibatch `loss` -> `after_backward`
    assert stab.calls[2:] == ["advantages"] + ["loss", "after_backward"] * n
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


def test_dead_layers_room_changes_at_onset_in_both_branches() -> None:
    task = DeadLayers()
    onset = task.budget("smoke").onset
    torch.manual_seed(0)
    run = task.build("smoke", 0, Stabilizer())
    for _ in range(onset):
        run.step(False)
    assert run.trainer.envs.get_attr("goal") == ((3, 3),) * 8  # the healthy phase: MiniGrid's corner goal
    for injected in (False, True):
        branch = copy.deepcopy(run)
        for _ in range(task.budget("smoke").iterations - onset):
            branch.step(injected)
        for _ in range(NEW_MAX_STEPS + 100):  # every env finishes the episode it began in the old room
            branch.trainer.iterate()
        assert branch.trainer.envs.get_attr("goal") == (NEW_GOAL,) * 8
        assert branch.trainer.envs.get_attr("max_steps") == (NEW_MAX_STEPS,) * 8
        assert branch.trainer.envs.get_attr("reward_scale") == ((1000.0,) if injected else (1.0,)) * 8
    assert run.trainer.envs.get_attr("goal") == ((3, 3),) * 8  # the healthy run is untouched


def test_dead_layers_anchors_make_not_learning_fail() -> None:
    task, room = DeadLayers(), new_room()
    # the new room's exact optimum: forward, turn right, forward onto the centre (3 steps); the ceiling is what the
    # control reaches (its post-onset mean), below the optimum
    assert room.optimal_return() == pytest.approx(1 - 0.9 * 3 / NEW_MAX_STEPS)
    assert task.return_ceiling < room.optimal_return()
    uniform, _ = room.evaluate(torch.zeros(len(room.obs), 3))  # what `no-update` (a near-uniform policy) earns
    threshold = task.ground_truth.threshold
    assert task.return_floor < threshold < task.return_ceiling and uniform < threshold
    # both optimal paths of the old room (top row then right column; left column then bottom row), ending in
    # a spin on the old goal's cell, never find the centre: the onset policy's habit is worth nothing here
    for old_path in ([2, 2, 1, 2, 2] + [0] * 4, [1, 2, 2, 0, 2, 2] + [0] * 4):
        logits = torch.full((len(room.obs), 3), -30.0)
        state = room.start
        for action in old_path:
            logits[state, action] = 30.0
            state = int(room.next_state[state, action])
            assert state >= 0
        assert room.states[state][:2] == (3, 3) and room.evaluate(logits)[0] < 1e-6


def test_moved_goal_room_steps_exactly_as_minigrid() -> None:
    from minigrid.envs import EmptyEnv
    from stabench.tasks.worlds.grids import EmptyRoomFlat, flatten_minigrid, place_goal

    fast = EmptyRoomFlat(size=5, max_steps=NEW_MAX_STEPS, goal=NEW_GOAL)
    ref = EmptyEnv(size=5, max_steps=NEW_MAX_STEPS)
    slow = flatten_minigrid(ref)
    slow.reset(seed=0)
    place_goal(ref, NEW_GOAL)
    fast.reset(seed=0)
    rng, ends = np.random.default_rng(0), 0
    for _ in range(2000):
        action = int(rng.choice(3, p=[0.2, 0.2, 0.6]))
        got, want = fast.step(action), slow.step(action)
        assert np.array_equal(got[0], want[0]) and got[1:4] == want[1:4]
        if got[2] or got[3]:
            ends += got[2]
            slow.reset()
            place_goal(ref, NEW_GOAL)
            fast.reset()
    assert ends >= 5
    # change_room takes effect at the next reset, not in the episode under way
    env = EmptyRoomFlat(size=5)
    env.reset(seed=0)
    env.change_room(NEW_GOAL, NEW_MAX_STEPS)
    env.step(2)
    assert env.goal == (3, 3) and env.max_steps == 100
    env.reset()
    assert env.goal == NEW_GOAL and env.max_steps == NEW_MAX_STEPS
    with pytest.raises(ValueError, match="not a free interior cell"):
        env.change_room((1, 1))  # the start cell


def test_fix_takes_the_reward_scale_out_of_the_critic_loss_only() -> None:
    fix = MultiSkipResidual()
    assert isinstance(fix.model(PlainMLP(SPEC), SPEC), MultiSkipResidualMLP)
    terms = {"policy": torch.tensor(0.3), "value": torch.tensor(2.0), "entropy": torch.tensor(-0.9)}
    returns = torch.tensor([0.0, 0.5, 0.86, 0.2])  # true returns (at most 1): the loss is left as it is
    same = fix.loss(dict(terms), {"returns": returns})
    assert all(torch.equal(same[k], terms[k]) for k in terms)
    scaled = fix.loss(dict(terms), {"returns": 1000.0 * returns})  # the shock: value term / E[R^2]
    assert torch.equal(scaled["policy"], terms["policy"]) and torch.equal(scaled["entropy"], terms["entropy"])
    assert float(scaled["value"]) == pytest.approx(2.0 / float((1000.0 * returns).pow(2).mean()), rel=1e-6)


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
    from stabench.tasks.worlds.grids import EmptyRoomFlat, flatten_minigrid

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
    from stabench.tasks.worlds.grids import EmptyRoomFlat

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
    from stabench.baselines.ppo import upper_quantile

    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 100, 128, 257):
        for x in (torch.rand(n, generator=g), torch.randn(n, generator=g).exp(),
                  torch.randint(0, 3, (n,), generator=g).float(), torch.ones(n), torch.rand(n, generator=g).double()):
            for q in (0.0, 0.5, 0.9, 0.99, 1.0):
                assert torch.equal(upper_quantile(x, q), torch.quantile(x, q)), (n, q)
