"""representation-collapse: the world, the exact evaluator, the spectrum diagnostic, the regularizer, the knobs."""

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
from stabench.baselines.stabilizers.entropy import EntropyBonus  # noqa: E402
from stabench.baselines.stabilizers.representation import (  # noqa: E402
    IsotropicGaussian,
    isotropic_gaussian_loss,
    random_directions,
)
from stabench.suite import registry  # noqa: E402
from stabench.suite.api import StabenchError, Stabilizer, TrainState  # noqa: E402
from stabench.suite.diagnostics import DIAGNOSTICS, effective_rank  # noqa: E402
from stabench.tasks.representation_collapse import (  # noqa: E402
    CELLS,
    ENV_ID,
    RepresentationCollapse,
    confident_shortfall,
    world_table,
)

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)


def same_rows(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all((math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a)


def test_spectrum_of_a_rank_one_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.outer(torch.arange(1.0, 29.0, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64))
    assert effective_rank(z) == pytest.approx(1.0, abs=1e-6)  # 28 x 16, rank 1
    assert effective_rank(z.float()) == pytest.approx(1.0, abs=1e-4)  # float32 round-off adds tiny values
    row = DIAGNOSTICS["spectrum"](TrainState(torch.nn.Linear(1, 1), {}, {}, {}, {"features": z}))
    assert row["effective_rank"] == pytest.approx(1.0, abs=1e-6)
    assert row["sv/00"] == pytest.approx(1.0, abs=1e-6)
    assert all(abs(row[f"sv/{i:02d}"]) < 1e-6 for i in range(1, 16))
    eye = DIAGNOSTICS["spectrum"](TrainState(torch.nn.Linear(1, 1), {}, {}, {}, {"features": torch.eye(16)}))
    assert eye["effective_rank"] == pytest.approx(16.0) and eye["sv/15"] == pytest.approx(1 / 16)
    missing = DIAGNOSTICS["spectrum"](TrainState(torch.nn.Linear(1, 1), {}, {}, {}))
    assert math.isnan(missing["effective_rank"]) and math.isnan(missing["sv/00"])


def test_isotropic_loss_small_for_gaussian_large_for_collapsed() -> None:
    g = torch.Generator().manual_seed(0)
    u = random_directions(16, 16, g)
    assert torch.allclose(u.norm(dim=0), torch.ones(16))
    gaussian = isotropic_gaussian_loss(torch.randn(4096, 16, generator=g), u)
    constant = isotropic_gaussian_loss(torch.full((4096, 16), 0.7), u)
    collapsed = isotropic_gaussian_loss(torch.randn(4096, 1, generator=g) * torch.ones(1, 16), u)  # rank 1
    assert gaussian < 1e-3
    assert constant > 0.1 and constant > 100 * gaussian
    assert collapsed > 10 * gaussian


@pytest.mark.filterwarnings("ignore:.*different from the unwrapped version")
def test_env_passes_check_env_and_matches_the_exact_table() -> None:
    env = gym.make(ENV_ID)
    check_env(env.unwrapped, skip_render_check=True)
    check_env(env, skip_render_check=True)
    assert env.observation_space.shape == (75,) and env.action_space == gym.spaces.Discrete(3)
    table = world_table()
    states = {(c, d): i for i, (c, d) in enumerate((c, d) for c in CELLS for d in range(4))}
    rng, base = np.random.default_rng(0), env.unwrapped
    for episode in range(30):
        obs, _ = env.reset(seed=episode)
        for _ in range(10):
            s = states[(tuple(int(v) for v in base.agent_pos), int(base.agent_dir))]
            assert table.start[s] and np.array_equal(table.obs[s].numpy(), obs)
            action = int(rng.integers(3))
            obs, reward, terminated, truncated, _ = env.step(action)
            s2 = states[(tuple(int(v) for v in base.agent_pos), int(base.agent_dir))]
            assert table.next_state[s, action] == s2
            assert terminated == (table.goal[s2] >= 0) and (reward > 0) == (table.goal[s2] == base.paying)
            if terminated or truncated:
                break


def test_exact_values_and_the_fixed_ceiling() -> None:
    table = world_table()
    n = len(table.goal)
    assert RepresentationCollapse.return_ceiling == table.optimum(0) == pytest.approx(table.optimum(1))
    uniform = np.full((n, 3), 1 / 3)
    assert 0.0 < table.value(uniform, 0) < table.optimum(0)
    assert confident_shortfall(0.0, 0.0) == 1.0 and confident_shortfall(0.0, math.log(3)) == 0.0
    assert math.isnan(confident_shortfall(math.nan, 0.5))


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"onset": -3}, "onset must be a positive integer"),
        ({"onset": 0}, "onset must be a positive integer"),
        ({"onset": 10_000}, "past every tier's horizon"),
        ({"fix": "no-such-fix"}, "unknown fix 'no-such-fix'"),
        ({"switch_every": 0}, "switch_every must be a positive integer"),
        ({"control": "nope"}, "unknown control 'nope'"),
        ({"colour": 1}, "unknown knob(s) colour"),
    ],
)
def test_bad_knobs_are_one_clear_error(knobs: dict, message: str) -> None:
    with pytest.raises(StabenchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RepresentationCollapse(**knobs)


def test_onset_past_a_tiers_horizon_fails_before_training() -> None:
    task = RepresentationCollapse(onset=50)  # inside quick (120), past smoke (6)
    assert task.budget("quick").onset == 50
    with pytest.raises(StabenchError, match="onset 50 must lie strictly inside the run of 6"):
        task.build("smoke", 0, Stabilizer())
    fixed = RepresentationCollapse(fix="entropy-bonus")
    assert fixed.matched_fix == "entropy-bonus" and fixed.role("entropy-bonus") == "matched-fix"


def test_registered_names_resolve() -> None:
    assert isinstance(registry.get_task("representation-collapse"), RepresentationCollapse)
    assert registry.resolve_class("stabilizer", "isotropic-gaussian") is IsotropicGaussian
    assert registry.resolve_class("stabilizer", "entropy-bonus") is EntropyBonus
    task = RepresentationCollapse()
    assert all(name in DIAGNOSTICS for name in task.diagnostics)
    assert all(registry.make_stabilizer(m).applies_to(task) for m in task.methods)


def test_rows_deterministic_per_seed_and_deepcopy_branches() -> None:
    task = RepresentationCollapse()
    rows = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)  # the global torch state must not matter
        run = task.build("smoke", 3, registry.make_stabilizer("isotropic-gaussian"))  # as the runner builds it
        rows.append([run.step(i >= 2) for i in range(3)])
    assert all(same_rows(a, b) for a, b in zip(*rows))
    row = rows[0][-1]
    for col in ("step", "return", "entropy", "tracking", "effective_rank", "sv/00", "sv/15", "state_entropy",
                "tracking_error", "confident_shortfall", "exact_return"):
        assert col in row
    assert row["paying"] == 1.0 and 1.0 <= row["effective_rank"] <= 16.0

    # the regularizer's feature tap follows the copy; the copy and the original are independent
    a, b = copy.deepcopy(run), copy.deepcopy(run)
    for r in (a, b):
        hooks = list(r.trainer.model.policy._forward_pre_hooks.values())
        assert hooks == [r.stabilizer.tap] and r.stabilizer is r.trainer.stabilizer
        assert r.stabilizer.calls > 0  # the regularizer ran on every minibatch
    assert a.stabilizer.tap is not run.stabilizer.tap
    assert same_rows(a.step(True), b.step(True))
    assert run.trainer.iteration == 3 and a.trainer.iteration == 4


def test_fresh_control_replaces_the_network_at_each_switch() -> None:
    task = RepresentationCollapse(switch_every=2, tracking_window=1)
    run = task.build("smoke", 0, EntropyBonus())  # onset 2, 6 iterations
    first = run.trainer.model
    rows = [run.step(False) for _ in range(6)]
    assert [r["networks"] for r in rows] == [1, 1, 2, 2, 3, 3]
    assert [r["paying"] for r in rows] == [0, 0, 1, 1, 0, 0]
    assert run.trainer.model is not first
    assert [math.isnan(r["tracking"]) for r in rows] == [True, True, True, False, True, False]
    fixed = RepresentationCollapse(switch_every=2, tracking_window=1, control="fixed").build("smoke", 0, Stabilizer())
    assert [fixed.step(False)["paying"] for _ in range(4)] == [0, 0, 0, 0]
