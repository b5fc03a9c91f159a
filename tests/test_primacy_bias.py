"""primacy-bias: the world, the exact evaluator, the spectrum diagnostic, the regularizer, the knobs."""

from __future__ import annotations

import copy
import math
import os
import re

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
from stabench.baselines.stabilizers.resets import HeadReset  # noqa: E402
from stabench.suite import registry  # noqa: E402
from stabench.suite.api import StabenchError, Stabilizer, TrainState  # noqa: E402
from stabench.suite.diagnostics import DIAGNOSTICS, effective_rank  # noqa: E402
from stabench.tasks.primacy_bias import (  # noqa: E402
    CELLS,
    ENV_ID,
    N_ACTIONS,
    PrimacyBias,
    TwoGoalsVectorEnv,
    confident_shortfall,
    cue_gap,
    make_two_goals,
    minigrid_two_goals,
    world_table,
)
from stabench.tasks.worlds.grids import make_env  # noqa: E402
from test_room_vector_env import same_step  # noqa: E402

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)


ONSET_RANGE = "primacy-bias: onset must be an integer in 1..119 (inside every quick and full run), got "


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
    assert len(table.goal) == 72 and table.start.sum() == 56
    states = {s: i for i, s in enumerate((c, cell, d) for c in range(2) for cell in CELLS for d in range(4))}
    rng, base = np.random.default_rng(0), env.unwrapped
    cues, paid = set(), {True: set(), False: set()}
    for episode in range(60):
        base.cued, base.paying = episode % 2 == 1, (episode // 2) % 2
        obs, _ = env.reset(seed=episode)
        cues.add(base.cue)
        for _ in range(10):
            s = states[(base.cue, tuple(int(v) for v in base.agent_pos), int(base.agent_dir))]
            assert table.start[s] and table.cue[s] == base.cue and np.array_equal(table.obs[s].numpy(), obs)
            action = int(rng.integers(3))
            obs, reward, terminated, truncated, _ = env.step(action)
            s2 = states[(base.cue, tuple(int(v) for v in base.agent_pos), int(base.agent_dir))]
            assert table.next_state[s, action] == s2
            pays = table.paying(base.paying, base.cued)[s2]
            assert pays == (base.cue ^ base.paying if base.cued else base.paying)
            assert terminated == (table.goal[s2] >= 0) and (reward > 0) == (table.goal[s2] == pays)
            if reward > 0:
                paid[base.cued].add((base.paying ^ base.cue if base.cued else base.paying, int(table.goal[s2])))
            if terminated or truncated:
                break
    assert cues == {0, 1}
    assert paid[False] == {(0, 0), (1, 1)} and paid[True] == {(0, 0), (1, 1)}  # (the rule's paying goal, reached)
    # the cue is visible: the two cues' views of the same cell and direction differ, on the walls only
    diff = (table.obs[:36] - table.obs[36:]).abs()
    assert (diff.sum(1) > 0).all() and set(np.unique(diff.numpy()).round(3)) == {0.0, 0.5}


@pytest.mark.parametrize(("seed", "paying", "cued"), [(0, 0, False), (1, 1, False), (2, 0, True), (3, 1, True)])
def test_table_driven_world_steps_and_starts_exactly_as_minigrid(seed: int, paying: int, cued: bool) -> None:
    fast, slow = make_two_goals(), minigrid_two_goals()
    for env in (fast, slow):
        env.unwrapped.paying, env.unwrapped.cued = paying, cued
    got, want = fast.reset(seed=seed)[0], slow.reset(seed=seed)[0]
    assert np.array_equal(got, want) and got.dtype == want.dtype
    rng, ends = np.random.default_rng(seed), {"paid": 0, "unpaid": 0, "truncated": 0}
    for _ in range(2000):
        action = int(rng.choice(3, p=[0.25, 0.25, 0.5]))
        got, want = fast.step(action), slow.step(action)
        assert np.array_equal(got[0], want[0]) and got[0].dtype == want[0].dtype
        assert got[1] == want[1] and got[2] == want[2] and got[3] == want[3]  # reward bit for bit
        if got[2] or got[3]:
            ends["truncated" if not got[2] else "paid" if got[1] > 0 else "unpaid"] += 1
            assert np.array_equal(fast.reset()[0], slow.reset()[0])  # the next cue and start, the same draws
            base = slow.unwrapped
            assert (fast.cue, fast.agent_pos, fast.agent_dir) == (base.cue, tuple(int(v) for v in base.agent_pos),
                                                                   int(base.agent_dir))
    assert min(ends.values()) >= 20


def test_table_driven_world_renders_as_minigrid() -> None:
    fast, slow = make_two_goals(render_mode="rgb_array"), minigrid_two_goals(render_mode="rgb_array")
    fast.reset(seed=3)
    slow.reset(seed=3)
    for action in (0, 2, 2, 1, 2):
        assert np.array_equal(fast.render(), slow.render())
        fast.step(action)
        slow.step(action)
    fast.close()
    slow.close()


def test_exact_values_the_frozen_policy_earns_half() -> None:
    table = world_table()
    n = len(table.goal)
    assert PrimacyBias.return_ceiling < table.optimum(0)
    assert table.optimum(0) == table.optimum(1) == pytest.approx(table.optimum(0, True)) == pytest.approx(0.6657142857)
    uniform = np.full((n, 3), 1 / 3)
    assert table.value(uniform, 0) == pytest.approx(table.value(uniform, 0, True))
    assert 0.0 < table.value(uniform, 0) < 0.2 * table.optimum(0)
    place = table.greedy(0)  # the healthy phase's optimum: the left goal from every state
    assert table.value(place, 0) == pytest.approx(table.optimum(0))
    assert table.value(place, 0, True) == pytest.approx(0.5 * table.optimum(0))  # right for one cue of two
    assert table.value(table.greedy(1, True), 1, True) == pytest.approx(table.optimum(0))
    assert table.value(table.greedy(0, True), 1, True) == 0.0  # the swapped meaning of the cue
    assert confident_shortfall(0.0, 0.0) == 1.0 and confident_shortfall(0.0, math.log(3)) == 0.0
    assert math.isnan(confident_shortfall(math.nan, 0.5))
    assert cue_gap(torch.ones(56, 16)) == 0.0


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"onset": -3}, ONSET_RANGE + "-3"),
        ({"onset": 0}, ONSET_RANGE + "0"),
        ({"onset": 150}, ONSET_RANGE + "150"),  # inside the full tier's run, past the quick tier's
        ({"onset": 10_000}, ONSET_RANGE + "10000"),
        ({"fix": "no-such-fix"}, "unknown fix 'no-such-fix'"),
        ({"fix": "baseline"}, "unknown fix 'baseline'"),
        ({"switch_every": 0}, "switch_every must be a positive integer"),
        ({"control": "fixed"}, "unknown control 'fixed'"),
        ({"reset": "nope"}, "unknown reset 'nope'"),
        ({"isotropic_lam": -1.0}, "isotropic_lam must be a number >= 0"),
        ({"colour": 1}, "primacy-bias: unknown knob colour; known: switch_every"),
        ({"tracking_window": 41}, "tracking_window 41 exceeds switch_every 40"),
        ({"depth": 1}, "depth must be at least 2"),
    ],
)
def test_bad_knobs_are_one_clear_error(knobs: dict, message: str) -> None:
    with pytest.raises(StabenchError, match=re.escape(message)):
        PrimacyBias(**knobs)


def test_onset_knob_moves_the_quick_and_full_onsets_and_fix_the_matched_fix() -> None:
    task = PrimacyBias(onset=50)
    assert task.budget("quick").onset == 50 and task.budget("full").onset == 50
    assert task.budget("smoke").onset == 2  # the smoke tier keeps its own, as for every task
    assert task.build("smoke", 0, Stabilizer()).budget.onset == 2
    fixed = PrimacyBias(fix="entropy-bonus")
    assert fixed.matched_fix == "entropy-bonus" and fixed.role("entropy-bonus") == "matched-fix"
    assert fixed.methods == ("baseline", "entropy-bonus")
    other = PrimacyBias(fix="grad-clip")
    assert other.methods == ("baseline", "grad-clip", "entropy-bonus") and other.role("grad-clip") == "matched-fix"
    assert PrimacyBias().matched_fix == "head-reset"  # the class attribute is untouched


def test_registered_names_resolve() -> None:
    assert isinstance(registry.get_task("primacy-bias"), PrimacyBias)
    assert registry.resolve_class("stabilizer", "isotropic-gaussian") is IsotropicGaussian
    assert registry.resolve_class("stabilizer", "entropy-bonus") is EntropyBonus
    assert registry.resolve_class("stabilizer", "head-reset") is HeadReset
    assert PrimacyBias().matched_fix == "head-reset"
    assert not HeadReset().applies_to(registry.get_task("entropy-collapse"))  # a GRPO task: no policy head
    task = PrimacyBias()
    assert all(name in DIAGNOSTICS for name in task.diagnostics)
    assert all(registry.make_stabilizer(m).applies_to(task) for m in task.methods)


def test_rows_deterministic_per_seed_and_deepcopy_branches() -> None:
    task = PrimacyBias()
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
    assert row["paying"] == 0.0 and row["cued"] == 1.0 and 1.0 <= row["effective_rank"] <= 16.0
    assert 0.0 <= row["cue_gap"] < 10.0

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
    task = PrimacyBias(switch_every=2, tracking_window=1)
    run = task.build("smoke", 0, EntropyBonus())  # onset 2, 6 iterations
    first = run.trainer.model
    rows = [run.step(False) for _ in range(6)]
    assert [r["networks"] for r in rows] == [1, 1, 2, 2, 3, 3]
    assert [r["cued"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert [r["paying"] for r in rows] == [0, 0, 0, 0, 1, 1]
    envs = run.trainer.envs
    assert list(envs.get_attr("cued")) == [True] * 8 and list(envs.get_attr("paying")) == [1] * 8
    assert run.trainer.model is not first
    assert [math.isnan(r["tracking"]) for r in rows] == [True, True, True, False, True, False]
    assert rows[3]["tracking"] == rows[3]["exact_return"]  # window 1: the period's last update


def test_default_schedule_reports_tracking_at_the_end_of_the_run() -> None:
    run = PrimacyBias(tracking_window=2).build("smoke", 0, Stabilizer())  # one period: updates 2-5
    rows = [run.step(True) for _ in range(6)]
    assert [r["cued"] for r in rows] == [0, 0, 1, 1, 1, 1] and run.networks == 1
    assert [math.isnan(r["tracking"]) for r in rows] == [True] * 5 + [False]
    assert rows[-1]["tracking"] == pytest.approx((rows[-1]["exact_return"] + rows[-2]["exact_return"]) / 2)
    assert rows[-1]["return"] == pytest.approx(rows[-1]["exact_return"] * world_table().optimum())


def test_tracking_reads_only_its_own_period() -> None:
    """A period the run cuts short (here one update) tracks over its own updates, never the previous period's."""
    run = PrimacyBias(switch_every=3, tracking_window=3).build("smoke", 0, Stabilizer())
    rows = [run.step(True) for _ in range(6)]  # periods: updates 2-4, then 5 (the run ends)
    assert [r["paying"] for r in rows] == [0, 0, 0, 0, 0, 1]
    assert [math.isnan(r["tracking"]) for r in rows] == [True, True, True, True, False, False]
    assert rows[4]["tracking"] == pytest.approx(sum(r["exact_return"] for r in rows[2:5]) / 3)
    assert rows[5]["tracking"] == rows[5]["exact_return"]


@pytest.mark.parametrize(("part", "changed"), [("head", {"policy"}), ("trunk", {"layers", "out"}),
                                                ("heads", {"policy", "value"})])
def test_reset_reinitializes_only_its_part_at_the_switch(part: str, changed: set[str]) -> None:
    run = PrimacyBias(reset=part).build("smoke", 0, Stabilizer())
    run.step(True), run.step(True)
    before = {k: v.clone() for k, v in run.trainer.model.state_dict().items()}
    optimizer = run.trainer.optimizer
    run.step(True)  # onset: the reset, then one update
    assert run.trainer.optimizer is not optimizer
    moved = {k.split(".")[0] for k, v in run.trainer.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed <= moved  # the reset part moved (re-initialized), the rest only by one update
    fresh = PrimacyBias().build("smoke", 0, Stabilizer())
    fresh.step(True), fresh.step(True), fresh.step(True)
    same = {k.split(".")[0] for k, v in run.trainer.model.state_dict().items()
            if torch.equal(v, fresh.trainer.model.state_dict()[k])}
    assert not (same & changed)


def test_isotropic_weight_is_a_task_setting_and_the_class_default_stays() -> None:
    assert IsotropicGaussian.lam == 5.0
    default = PrimacyBias().build("smoke", 0, registry.make_stabilizer("isotropic-gaussian"))
    assert default.stabilizer.inner.lam == 5.0
    set_ = PrimacyBias(isotropic_lam=2.0).build("smoke", 0, registry.make_stabilizer("isotropic-gaussian"))
    assert set_.stabilizer.inner.lam == 2.0 and IsotropicGaussian.lam == 5.0
    assert set_.trainer.stabilizer is set_.stabilizer  # the trainer runs the configured one
    # the method's public setting: the same class `isotropic-gaussian@lam=2` builds
    assert type(set_.stabilizer.inner) is registry.resolve_class("stabilizer", "isotropic-gaussian@lam=2")


def test_head_reset_fires_when_the_smoothed_reward_rate_falls_by_drop() -> None:
    fix = HeadReset()  # window 5, drop 0.3
    assert not any(fix.fell(r) for r in [0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.28, 0.3])  # learning, then noise
    assert fix.best == pytest.approx(0.296)
    assert [fix.fell(0.1) for _ in range(3)] == [False, False, True]  # smoothed 0.256, 0.216, 0.176 < 0.207
    fix.rates, fix.best = [0.5] * 5, 0.5
    network = PrimacyBias().build("smoke", 0, Stabilizer()).trainer.model
    assert fix.model(network, {}) is network and fix.net is network
    assert fix.rates == [] and fix.best == -math.inf  # a new network starts its own record


def test_head_reset_reinitializes_the_policy_head_and_adam_and_skips_that_policy_step() -> None:
    run = PrimacyBias().build("smoke", 0, registry.make_stabilizer("head-reset"))
    fix = run.stabilizer.inner
    assert fix.net is run.trainer.model and fix.opt is run.trainer.optimizer
    run.step(False)
    assert fix.resets == 0 and len(run.trainer.optimizer.state) > 0
    before = {k: v.clone() for k, v in run.trainer.model.state_dict().items()}
    fix.rates, fix.best = [0.0] * 4, 1.0  # a record the next rollout (reward 0) completes far below its best
    obs = world_table().obs[:8]
    batch = {"obs": obs, "actions": torch.zeros(8, dtype=torch.long), "rewards": torch.zeros(8),
             "advantages": torch.ones(8), "old_logp": torch.zeros(8), "anchor_logp": torch.zeros(8),
             "behaviour_logp": torch.zeros(8)}
    out = fix.rollout(batch, {})
    after = run.trainer.model.state_dict()
    moved = {k for k, v in after.items() if not torch.equal(v, before[k])}
    assert moved == {"policy.weight", "policy.bias"} and fix.resets == 1
    assert float(after["policy.bias"].abs().max()) == 0.0 and float(after["policy.weight"].norm()) < 0.1
    assert len(run.trainer.optimizer.state) == 0  # Adam's moments start afresh
    assert torch.equal(out["advantages"], torch.zeros(8))  # no policy step on the stale batch
    want = torch.log_softmax(run.trainer.model(obs)[0], -1)[:, 0]
    assert torch.allclose(out["old_logp"], want) and torch.allclose(out["anchor_logp"], want)
    assert torch.equal(out["behaviour_logp"], batch["behaviour_logp"])
    assert fix.rollout(batch, {}) is batch  # the record restarted: no second reset

    branch = copy.deepcopy(run)  # a branch's stabilizer resets the branch's own network
    copied = branch.stabilizer.inner
    assert copied.net is branch.trainer.model and copied.opt is branch.trainer.optimizer


def test_vector_world_equals_the_sync_vector_env_it_replaces() -> None:
    """The numpy vector world the runs use steps as the SyncVectorEnv of wrapped single worlds, bit for bit."""
    n = 6
    ref = gym.vector.SyncVectorEnv([lambda: make_env(ENV_ID) for _ in range(n)],
                                   autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    mine = TwoGoalsVectorEnv(n)
    o1, o2 = ref.reset(seed=3)[0], mine.reset(seed=3)[0]
    assert np.array_equal(o1, o2) and o1.dtype == o2.dtype
    rng, ended = np.random.default_rng(0), 0
    for k in range(1500):
        if k == 300:  # the cued rule, then the swap, mid-episode as the task sets them
            for env in (ref, mine):
                env.set_attr("cued", True)
        if k == 900:
            for env in (ref, mine):
                env.set_attr("paying", 1)
        actions = rng.integers(0, N_ACTIONS, size=n)
        ended += same_step(ref.step(actions), mine.step(actions), k)
        for name in ("cue", "paying", "cued"):
            assert tuple(ref.get_attr(name)) == mine.get_attr(name)
    assert ended > 1000 and mine.get_attr("paying") == (1,) * n
    with pytest.raises(ValueError):
        mine.step(np.array([0, 3, 0, 0, 0, 0]))
    with pytest.raises(AttributeError):
        mine.set_attr("max_steps", 5)
