"""policy-churn: the churn diagnostic, CHAIN's regularizer, the DQN trainer's hooks, the world and the knobs."""

from __future__ import annotations

import copy
import math
import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from stabench.baselines.dqn import DQN, DQNConfig, QNetwork, q_spec
from stabench.baselines.stabilizers.critics import Chain, chain_regularizer
from stabench.suite import registry
from stabench.suite.api import Diverged, StabenchError, Stabilizer, TrainState
from stabench.suite.diagnostics import DIAGNOSTICS
from stabench.tasks.policy_churn import (
    ENV_ID,
    ROTATION,
    WALLS,
    PocketVectorEnv,
    PolicyChurn,
    RelabeledEnvs,
    frozen_units,
    make_pocket_random_flat,
    minigrid_pocket_random_flat,
    optimal_return,
    state_table,
)
from stabench.tasks.worlds.grids import make_env, make_vector_env
from test_room_vector_env import same_step

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)

TINY = DQNConfig(num_envs=2, num_steps=8, updates_per_iteration=3, batch_size=8, ref_batch_size=4,
                 buffer_size=64, learning_starts=0, target_every=2, seed=0)


def same_rows(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all((math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a)


def test_churn_diagnostic_counts_known_flips() -> None:
    # Q(s) = s @ W on 10 one-hot held-out states; the update raises action 1 above action 0 on exactly 3 of them.
    states = torch.eye(10)
    w0 = torch.zeros(10, 3)
    w0[:, 0] = 1.0
    w1 = w0.clone()
    w1[[2, 5, 7], 1] = 2.0
    w2 = w1.clone()  # a second update that changes nothing
    q = torch.stack([states @ w0, states @ w1, states @ w2])
    row = DIAGNOSTICS["churn"](TrainState(model=torch.nn.Identity(), batch={}, grads={}, losses={},
                                          extras={"heldout_q": q}))
    assert row["policy_churn"] == pytest.approx((0.3 + 0.0) / 2)  # per update, averaged over the two updates
    assert row["policy_churn_iter"] == pytest.approx(0.3)
    assert row["value_churn"] == pytest.approx((3 * 2.0 / 30 + 0.0) / 2)
    empty = DIAGNOSTICS["churn"](TrainState(model=torch.nn.Identity(), batch={}, grads={}, losses={}))
    assert all(math.isnan(v) for v in empty.values())  # missing, never zero


def test_chain_regularizer_zero_iff_q_unchanged() -> None:
    q = torch.randn(5, 3)
    assert float(chain_regularizer(q, q.clone())) == 0.0
    assert float(chain_regularizer(q + 0.1, q)) == pytest.approx(0.01)

    for auto in (False, True):
        torch.manual_seed(0)
        net = QNetwork(q_spec(147, 3, 8, 1))
        chain = Chain()
        chain.auto = auto
        chain.model(net, net.spec)
        batch = {"ref_obs": torch.rand(6, 147)}
        td = {"td": torch.tensor(0.5)}
        first = chain.loss(dict(td), batch)
        assert set(first) == {"td", "chain"} and float(first["chain"].detach()) == 0.0  # Q_prev = Q at first
        again = chain.loss(dict(td), batch)
        assert float(again["chain"].detach()) == 0.0  # no step was taken in between
        with torch.no_grad():
            net.head.bias.add_(0.3)  # "an update" that moves every Q by 0.3
        moved = chain.loss(dict(td), batch)
        # fixed: lambda * 0.3^2; automatic: lambda = beta * mean|L_td| / mean(L_reg) over 3 calls = beta * 0.5 / 0.03
        lam = chain.beta * 0.5 / (0.09 / 3) if auto else chain.lam
        assert float(moved["chain"].detach()) == pytest.approx(lam * 0.09, rel=1e-4)
        moved["chain"].backward()
        assert net.head.bias.grad is not None and float(net.head.bias.grad.abs().sum()) > 0
        settled = chain.loss(dict(td), batch)  # Q_prev is now the moved network
        assert float(settled["chain"].detach()) == 0.0


class Recording(Stabilizer):
    name = "recording"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def model(self, model, spec):
        self.calls.append("model")
        return model

    def optimizer(self, optimizer, model):
        self.calls.append("optimizer")
        return optimizer

    def loss(self, terms, batch):
        self.calls.append("loss")
        assert set(terms) == {"td"}
        assert {"obs", "actions", "rewards", "next_obs", "terminated", "td_target", "ref_obs"} <= set(batch)
        return terms

    def after_backward(self, model):
        self.calls.append("after_backward")
        assert all(p.grad is not None for p in model.parameters())


def test_dqn_hooks_order_and_train_state() -> None:
    torch.manual_seed(0)
    rec = Recording()
    heldout = state_table().obs[:7]
    dqn = DQN(make_vector_env(ENV_ID, TINY.num_envs), QNetwork(q_spec(147, 3, 16, 1)), TINY, rec, heldout_obs=heldout)
    assert rec.calls == ["model", "optimizer"]
    state = dqn.iterate()
    assert rec.calls[2:] == ["loss", "after_backward"] * TINY.updates_per_iteration
    assert state.extras["global_step"] == TINY.num_envs * TINY.num_steps
    assert state.extras["heldout_q"].shape == (TINY.updates_per_iteration + 1, 7, 3)
    assert state.extras["heldout_in_batch"].shape == (TINY.updates_per_iteration, 7)
    row = DIAGNOSTICS["churn"](state)
    assert 0.0 <= row["policy_churn"] <= 1.0 and row["value_churn"] > 0
    assert set(state.grads) == {n for n, _ in dqn.model.named_parameters()}
    assert 0.0 < state.losses["entropy"] <= math.log(3) + 1e-6
    assert state.batch["ref_obs"].shape == (TINY.ref_batch_size, 147)


def test_heldout_in_batch_marks_exactly_the_heldout_observations_in_the_td_batch() -> None:
    torch.manual_seed(0)
    table = state_table()
    dqn = DQN(make_vector_env(ENV_ID, TINY.num_envs), QNetwork(q_spec(147, 3, 16, 1)), TINY, heldout_obs=table.obs)
    for _ in range(3):
        state = dqn.iterate()
    batch = state.batch["obs"]  # the last update's TD batch and its row of the mask
    want = torch.tensor([bool((batch == row).all(1).any()) for row in table.obs])
    assert want.any() and torch.equal(state.extras["heldout_in_batch"][-1], want)


def test_heldout_q_riding_along_the_td_forward_equals_its_own_forward() -> None:
    """The plain network computes the held-out Q inside the TD forward; a hooked one (which must not see extra
    rows) computes it apart. Same seed, same draws: the same Q up to float summation order."""
    states = []
    for hooked in (False, True):
        torch.manual_seed(0)
        model = QNetwork(q_spec(147, 3, 16, 1))
        if hooked:
            model.register_forward_hook(lambda module, args, out: None)
        dqn = DQN(make_vector_env(ENV_ID, TINY.num_envs), model, TINY, heldout_obs=state_table().obs)
        states.append(dqn.iterate())
    (plain, apart) = (s.extras["heldout_q"] for s in states)
    assert plain.shape == apart.shape == (TINY.updates_per_iteration + 1, len(state_table().obs), 3)
    assert torch.allclose(plain, apart, atol=1e-6)
    assert torch.equal(states[0].extras["heldout_in_batch"], states[1].extras["heldout_in_batch"])


def test_subnormals_flushed_only_inside_an_iteration() -> None:
    tiny = torch.tensor([1e-39])  # a subnormal float32: kept by IEEE arithmetic, zeroed when flushed
    dqn = DQN(make_vector_env(ENV_ID, TINY.num_envs), QNetwork(q_spec(147, 3, 16, 1)), TINY)
    seen = []

    class Probe(Stabilizer):
        def loss(self, terms, batch):
            seen.append(float(tiny * 1.0))
            return terms

    dqn.stabilizer = Probe()
    dqn.iterate()
    assert seen and all(v == 0.0 for v in seen)
    assert float(tiny * 1.0) > 0.0


@pytest.mark.parametrize(("seed", "walls"), [(0, WALLS), (7, WALLS), (3, ())])
def test_table_driven_world_steps_and_starts_exactly_as_minigrid(seed: int, walls: tuple) -> None:
    fast, slow = make_pocket_random_flat(walls=walls), minigrid_pocket_random_flat(walls=walls)
    got, want = fast.reset(seed=seed)[0], slow.reset(seed=seed)[0]
    assert np.array_equal(got, want) and got.dtype == want.dtype
    rng, ends = np.random.default_rng(seed), {"terminated": 0, "truncated": 0}
    for _ in range(3000):
        action = int(rng.choice(3, p=[0.2, 0.2, 0.6]))
        got, want = fast.step(action), slow.step(action)
        assert np.array_equal(got[0], want[0]) and got[0].dtype == want[0].dtype
        assert got[1] == want[1] and got[2] == want[2] and got[3] == want[3]  # reward bit for bit
        if got[2] or got[3]:
            ends["terminated" if got[2] else "truncated"] += 1
            assert np.array_equal(fast.reset()[0], slow.reset()[0])  # the next random start, the same draws
            assert fast.agent_pos == tuple(int(v) for v in slow.unwrapped.agent_pos)
            assert fast.agent_dir == int(slow.unwrapped.agent_dir)
    assert ends["terminated"] >= 5 and ends["truncated"] >= 20  # wandering rarely finds the pocket's goal


@pytest.mark.parametrize("walls", [WALLS, ()])
def test_vector_world_equals_the_sync_vector_env_it_replaces(walls: tuple) -> None:
    """The numpy vector world the runs use steps as the SyncVectorEnv of wrapped single worlds, bit for bit,
    random starts and the last view of every finished episode (DQN's `final_obs`) included."""
    n = 6
    ref = gym.vector.SyncVectorEnv([lambda: make_env(ENV_ID, walls=walls) for _ in range(n)],
                                   autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    mine = PocketVectorEnv(n, walls)
    o1, o2 = ref.reset(seed=5)[0], mine.reset(seed=5)[0]
    assert np.array_equal(o1, o2) and o1.dtype == o2.dtype
    rng, ended, goals = np.random.default_rng(0), 0, 0
    for k in range(2000):
        actions = rng.choice(3, size=n, p=[0.2, 0.2, 0.6])
        a, b = ref.step(actions), mine.step(actions)
        ended += same_step(a, b, k)
        goals += int(a[2].sum())
        done = a[2] | a[3]
        for i in np.flatnonzero(done):
            assert np.array_equal(a[4]["final_obs"][i], b[4]["final_obs"][i]), k
    assert ended > 200 and goals >= 10


def test_dqn_raises_diverged_on_non_finite_loss() -> None:
    class Poison(Stabilizer):
        def loss(self, terms, batch):
            return {**terms, "poison": torch.tensor(float("nan"))}

    torch.manual_seed(0)
    dqn = DQN(make_vector_env(ENV_ID, TINY.num_envs), QNetwork(q_spec(147, 3, 16, 1)), TINY, Poison())
    with pytest.raises(Diverged):
        dqn.iterate()


def test_rows_deterministic_per_seed_and_branching() -> None:
    task = PolicyChurn()
    assert all(name in DIAGNOSTICS for name in task.diagnostics)
    rows = []
    for global_seed in (123, 456):
        torch.manual_seed(global_seed)  # the global torch state must not matter
        run = task.build("smoke", 1, registry.make_stabilizer("chain"))
        rows.append([run.step(i >= 3) for i in range(6)])  # onset 3; updates restart at iteration 4
    assert all(same_rows(x, y) for x, y in zip(*rows))
    row = rows[0][-1]
    for col in ("step", "return", "entropy", "policy_churn", "value_churn", task.ground_truth.metric,
                task.detector.metric):
        assert col in row and math.isfinite(row[col])
    assert 0.0 <= row["return"] <= optimal_return() + 1e-9

    run = task.build("smoke", 0, Stabilizer())
    run.step(False)
    a, b = copy.deepcopy(run), copy.deepcopy(run)
    assert same_rows(a.step(True), b.step(True))
    lr = task.knobs.lr_mult * run.cfg.learning_rate
    assert a.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(lr)
    assert run.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(run.cfg.learning_rate)  # untouched


@pytest.mark.filterwarnings("ignore:.*different from the unwrapped version")
def test_world_passes_check_env_and_table_matches_env() -> None:
    env = gym.make(ENV_ID)
    check_env(env.unwrapped, skip_render_check=True)
    check_env(env, skip_render_check=True)
    table = state_table()
    assert len(table.states) == 13 * 4  # 4 x 4 interior cells minus the goal and the two walls, 4 directions
    index = {st: i for i, st in enumerate(table.states)}
    rng = np.random.default_rng(0)
    for episode in range(5):  # driving the real env agrees with the table's observations and transitions
        obs, _ = env.reset(seed=episode)
        base = env.unwrapped
        s = index[(int(base.agent_pos[0]), int(base.agent_pos[1]), int(base.agent_dir))]
        for _ in range(20):
            assert torch.equal(table.obs[s], torch.as_tensor(obs))
            a = int(rng.integers(3))
            obs, _, terminated, truncated, _ = env.step(a)
            s = int(table.next_state[s, a])
            if terminated:
                assert s == -1
                break
            assert s == index[(int(base.agent_pos[0]), int(base.agent_pos[1]), int(base.agent_dir))]
    # the exact optimum; the normalization is anchored on the frozen policy (0) and the control's reach, below it
    assert optimal_return() == pytest.approx(0.8511538461538463, abs=1e-9)
    assert optimal_return(walls=()) == pytest.approx(0.89875, abs=1e-9)  # version 2's empty room
    assert PolicyChurn.return_floor == 0.0 < PolicyChurn.return_ceiling < optimal_return()
    # a policy that only turns never arrives
    dist = table.greedy_steps(np.full(len(table.obs), 2))  # always forward: only the state facing into the pocket
    assert np.isfinite(dist).sum() == 1
    assert table.greedy_return(np.zeros(len(table.obs), dtype=np.int64)) == 0.0


def test_wandering_policies_earn_little_in_the_pocket() -> None:
    # An untrained network's greedy policy is close to one action everywhere. In the empty room "always forward"
    # arrives from 6 of 60 starts; behind the pocket's walls from 1 of 52, under either rule.
    for walls, most in ((WALLS, 0.02), ((), 0.1)):
        table = state_table(walls=walls)
        for next_state in (table.next_state, table.next_state[:, ROTATION]):
            constant = [table.greedy_return(np.full(len(table.obs), a), next_state) for a in range(3)]
            assert max(constant) < most and sorted(constant)[:2] == [0.0, 0.0]


ONSET_RANGE = "policy-churn: onset must be an integer in 1..69 (inside every quick and full run), got "


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"updates_mult": 0}, "updates_mult must be an integer >= 1, got 0"),
    ({"updates_mult": 2.5}, "updates_mult must be an integer >= 1, got 2.5"),
    ({"updates_mult": True}, "updates_mult must be an integer >= 1, got True"),
    ({"lr_mult": 0.0}, "lr_mult must be a finite number > 0, got 0.0"),
    ({"lr_mult": float("inf")}, "lr_mult must be a finite number > 0, got inf"),
    ({"ramp": -1}, "ramp must be an integer >= 0, got -1"),
    ({"onset": 0}, ONSET_RANGE + "0"),
    ({"onset": 70}, ONSET_RANGE + "70"),
    ({"onset": 2.5}, ONSET_RANGE + "2.5"),
    ({"bogus": 1}, "policy-churn: unknown knob bogus"),
    ({"target_every": -1}, "target_every must be an integer >= 0, got -1"),
    ({"target_every": 1.5}, "target_every must be an integer >= 0, got 1.5"),
    ({"shift": 1}, "shift must be a bool, got 1"),
    ({"activation": "gelu"}, "activation must be 'tanh' or 'relu', got 'gelu'"),
    ({"room": "maze"}, "room must be one of pocket, empty, got 'maze'"),
])
def test_knob_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(StabenchError, match=re.escape(message)):
        PolicyChurn(**kwargs)


def test_intensity_grid_and_frozen_units() -> None:
    cells = PolicyChurn().grid("intensity", "quick")
    assert len(cells) == 10 and all(PolicyChurn(**cell).knobs.lr_mult == cell["lr_mult"] for cell in cells)
    with pytest.raises(StabenchError):
        PolicyChurn().grid("no-such-grid", "quick")
    assert PolicyChurn(onset=30).budget("quick").onset == 30 and PolicyChurn(onset=30).budget("smoke").onset == 3
    varying = torch.linspace(-0.5, 0.5, 60)[:, None]
    saturated = torch.full((60, 1), 0.999)
    assert frozen_units([torch.cat([varying, saturated, varying], 1)]) == pytest.approx(1 / 3)
    assert math.isnan(frozen_units([]))


def optimal_actions(next_state: np.ndarray) -> np.ndarray:
    """A shortest-path greedy policy on a transition table (Bellman-Ford on unit costs)."""
    dist = np.full(len(next_state), math.inf)
    for _ in range(len(next_state) + 1):
        dist = np.minimum(dist, (1.0 + np.where(next_state < 0, 0.0, dist[np.maximum(next_state, 0)])).min(1))
    succ = np.where(next_state < 0, 0.0, dist[np.maximum(next_state, 0)])
    return succ.argmin(1)


def test_rotation_demands_relearning() -> None:
    table = state_table()
    rotated = table.next_state[:, ROTATION]
    old = optimal_actions(table.next_state)
    assert table.greedy_return(old) == pytest.approx(optimal_return())
    # the policy that was optimal before onset earns almost nothing under the new rule (it mostly loops) ...
    assert table.greedy_return(old, rotated) < 0.15
    # ... while the optimum under the new rule is the same number (a relabeling of the same world)
    assert table.greedy_return(optimal_actions(rotated), rotated) == pytest.approx(optimal_return())
    assert sorted(ROTATION.tolist()) == [0, 1, 2] and all(ROTATION != np.arange(3))


@pytest.mark.filterwarnings("ignore:.*different from the unwrapped version")
def test_relabeled_envs_execute_the_rotated_action() -> None:
    plain, relabeled = make_vector_env(ENV_ID, 2), RelabeledEnvs(make_vector_env(ENV_ID, 2), ROTATION)
    a, _ = plain.reset(seed=3)
    b, _ = relabeled.reset(seed=3)
    assert np.array_equal(a, b)
    for action in (0, 1, 2, 2, 1):
        a = plain.step(np.full(2, ROTATION[action]))[0]
        b = relabeled.step(np.full(2, action))[0]
        assert np.array_equal(a, b)


def test_onset_shifts_both_branches_and_injects_only_one() -> None:
    task = PolicyChurn()
    run = task.build("smoke", 0, Stabilizer())
    onset = task.budget("smoke").onset
    for _ in range(onset):
        run.step(False)
    assert run.trainer.updates > 0 and run.trainer.buffer.size == onset * 128
    base = run.cfg
    inj, ctl = copy.deepcopy(run), copy.deepcopy(run)
    inj.step(True)
    ctl.step(False)
    for branch in (inj, ctl):  # the new rule, in both branches: relabeled actions, replay emptied, epsilon 1
        assert isinstance(branch.trainer.envs, RelabeledEnvs)
        assert np.array_equal(branch.next_state, branch.table.next_state[:, ROTATION])
        assert branch.trainer.buffer.size == 128
        assert branch.trainer.epsilon() > 0.9
    assert not isinstance(run.trainer.envs, RelabeledEnvs)  # the copy at onset is untouched
    # the injection, only in its branch: more updates per iteration, a higher lr, the target synced every update
    assert inj.trainer.updates_per_iteration == base.updates_per_iteration * task.knobs.updates_mult
    assert inj.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(base.learning_rate * task.knobs.lr_mult)
    assert inj.trainer.cfg.target_every == task.knobs.target_every == 1
    assert ctl.trainer.updates_per_iteration == base.updates_per_iteration
    assert ctl.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(base.learning_rate)
    assert ctl.trainer.cfg.target_every == base.target_every
    for _ in range(3):  # learning restarts once the new replay holds learning_starts transitions
        inj.step(True)
        ctl.step(False)
    assert inj.trainer.updates - run.trainer.updates == 2 * (ctl.trainer.updates - run.trainer.updates) > 0
    with torch.no_grad():  # the target network equals the network in the injected branch (synced every update)
        q = inj.table.obs
        assert torch.equal(inj.trainer.target(q), inj.trainer.model(q))
