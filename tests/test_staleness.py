"""parallel-staleness: the lagged actors, the table-driven room, the off-policy stabilizers' formulas, the knobs."""

from __future__ import annotations

import copy
import math
import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from stabench.baselines.ppo import PPO, PPOConfig
from stabench.baselines.stabilizers.clipping import DualClip
from stabench.baselines.stabilizers.importance import TokenTIS, VTrace, vtrace
from stabench.suite import registry
from stabench.suite.api import StabenchError, Stabilizer
from stabench.suite.runner import ExperimentSpec
from stabench.tasks.parallel_staleness import (
    ParallelStaleness,
    RoomVectorEnv,
    SeparateActorCritic,
    make_room,
    room_table,
    staleness_grid,
)

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)

SMALL = {"num_envs": 4, "num_steps": 16, "epochs": 2, "epochs_before": 2, "num_minibatches": 2, "lag": 2}


def same_rows(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all((math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a)


def test_room_vector_env_matches_minigrid() -> None:
    n = 3
    ref = gym.vector.SyncVectorEnv([lambda: gym.wrappers.RecordEpisodeStatistics(make_room(6, 30))] * n,
                                   autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    mine = RoomVectorEnv(6, 30, n)
    assert np.array_equal(ref.reset(seed=0)[0], mine.reset(seed=0)[0])
    rng, ended = np.random.default_rng(0), 0
    for _ in range(400):
        act = rng.choice(3, size=n, p=[0.15, 0.15, 0.7])
        o1, r1, te1, tr1, i1 = ref.step(act)
        o2, r2, te2, tr2, i2 = mine.step(act)
        assert np.array_equal(o1, o2) and np.allclose(r1, r2)
        assert np.array_equal(te1, te2) and np.array_equal(tr1, tr2)
        f1, f2 = i1.get("final_info", {}), i2.get("final_info", {})
        assert ("episode" in f1) == ("episode" in f2)
        if "episode" in f1:
            m = f1["_episode"]
            assert np.array_equal(m, f2["_episode"]) and np.allclose(f1["episode"]["r"][m], f2["episode"]["r"][m])
            ended += int(m.sum())
    assert ended > 10


def test_exact_evaluation() -> None:
    table = room_table(6, 30)
    assert table.optimal_return() == pytest.approx(1 - 0.9 * 7 / 30)  # 7 steps: 3 forward, turn, 3 forward
    ret, ent = table.evaluate(torch.zeros(len(table.obs), 3))
    assert ent == pytest.approx(math.log(3)) and 0.03 < ret < 0.04  # uniform-random policy
    # a policy that is a function of the observation, against Monte Carlo on the table-driven env
    w = torch.randn(147, 3, generator=torch.Generator().manual_seed(0)) * 0.5
    exact, _ = table.evaluate(table.obs @ w)
    env, rng, returns = RoomVectorEnv(6, 30, 64), np.random.default_rng(0), []
    obs, _ = env.reset()
    while len(returns) < 3000:
        probs = torch.softmax(torch.as_tensor(obs) @ w, -1).double().numpy()
        act = (probs.cumsum(-1) < rng.random(len(probs))[:, None]).sum(-1)
        obs, _, _, _, info = env.step(np.minimum(act, 2))
        if "final_info" in info:
            returns += list(info["final_info"]["episode"]["r"][info["final_info"]["_episode"]])
    assert abs(np.mean(returns) - exact) < 4 * np.std(returns) / math.sqrt(len(returns))


def test_lag_makes_behaviour_differ_only_after_onset() -> None:
    task = ParallelStaleness(**SMALL)
    run = task.build("smoke", 0, Stabilizer())  # smoke: onset at iteration 2
    healthy = [run.step(False) for _ in range(2)]
    assert all(r["behaviour_kl"] == 0.0 and r["actor_lag"] == 0 and r["rho_max"] == 1.0 for r in healthy)
    injected, control = copy.deepcopy(run), copy.deepcopy(run)
    rows = [injected.step(True) for _ in range(2)]
    assert all(r["behaviour_kl"] > 0 and r["actor_lag"] == 2 for r in rows)
    assert rows[0]["rho_max"] > 1.0
    assert injected.trainer.cfg.update_epochs == SMALL["epochs"]
    assert all(control.step(False)["behaviour_kl"] == 0.0 for _ in range(2))
    assert control.trainer.cfg.update_epochs == SMALL["epochs"]  # the epoch change is in both branches
    assert run.trainer.actor_lag == 0 and run.trainer.cfg.update_epochs == SMALL["epochs_before"]


def test_lagged_actor_uses_old_parameters() -> None:
    torch.manual_seed(0)
    cfg = PPOConfig(num_envs=2, num_steps=8, update_epochs=1, num_minibatches=1, seed=0)
    ppo = PPO(RoomVectorEnv(6, 30, 2), SeparateActorCritic(16), cfg)
    start = copy.deepcopy(ppo.model.state_dict())
    ppo.actor_history, ppo.actor_lag = 3, 3
    state = ppo.iterate()  # only one snapshot: the learner acts itself
    assert state.extras["actor_lag"] == 0 and torch.equal(state.batch["old_logp"], state.batch["behaviour_logp"])
    state = ppo.iterate()
    assert state.extras["actor_lag"] == 1
    assert all(torch.equal(ppo.actor.state_dict()[k], v) for k, v in start.items())
    assert not torch.allclose(state.batch["old_logp"], state.batch["behaviour_logp"])


def minibatch() -> dict[str, torch.Tensor]:
    """A PPO minibatch as the `loss` hook sees it (`suite.api.BATCH_SCHEMA`): token_weight 1 / size (a mean)."""
    return {
        "behaviour_logp": torch.log(torch.tensor([0.5, 0.1, 0.4, 0.2])),  # behaviour
        "anchor_logp": torch.log(torch.tensor([0.5, 0.1, 0.4, 0.2])),  # PPO's term is formed against it
        "old_logp": torch.log(torch.tensor([0.5, 0.4, 0.1, 0.6])),  # learner at the update's start
        "logp": torch.log(torch.tensor([0.55, 0.5, 0.05, 0.9])),
        "advantages": torch.tensor([1.0, -2.0, 0.5, -1.0]),
        "mask": torch.ones(4),
        "token_weight": torch.full((4,), 0.25),
        "clip_low": torch.tensor(0.2),
        "clip_high": torch.tensor(0.2),
    }


def ppo_term(r: float, a: float, eps: float = 0.2) -> float:
    return max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))


def terms() -> dict[str, torch.Tensor]:
    return {"policy": torch.tensor(0.0), "value": torch.tensor(1.5)}


def test_token_tis_formula() -> None:
    mb = minibatch()
    b, old, new = (mb[k].exp().tolist() for k in ("behaviour_logp", "old_logp", "logp"))
    adv = mb["advantages"].tolist()
    want = np.mean([min(o / bb, 2.0) * ppo_term(n / o, a) for bb, o, n, a in zip(b, old, new, adv)])
    out = TokenTIS().loss(terms(), mb)
    assert float(out["policy"]) == pytest.approx(want, rel=1e-5) and float(out["value"]) == 1.5


def test_dual_clip_formula() -> None:
    mb = minibatch()
    mb["logp"] = mb["anchor_logp"] + torch.log(torch.tensor([5.0, 5.0, 2.0, 0.5]))  # r vs the anchor
    # A = 1, r = 5: clipped at 1.2; A = -2, r = 5: PPO term 10, dual clip bounds it at 3 * 2; A = 0.5, r = 2:
    # clipped; A = -1, r = 0.5: PPO term 0.8 (clipped side), below 3: unchanged
    want = np.mean([-1.2, 6.0, -0.6, 0.8])
    assert float(DualClip().loss(terms(), mb)["policy"]) == pytest.approx(want, rel=1e-5)
    base = np.mean([ppo_term(r, a) for r, a in zip([5.0, 5.0, 2.0, 0.5], [1.0, -2.0, 0.5, -1.0])])
    assert base == pytest.approx(np.mean([-1.2, 10.0, -0.6, 0.8]))


def test_vtrace_formula() -> None:
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0], [1.0], [0.0]])
    values = torch.tensor([[0.5], [0.2], [0.3]])
    dones = torch.tensor([[0.0], [0.0], [1.0]])  # obs 2 starts a new episode: step 1 ended one
    next_value, next_done = torch.tensor([0.4]), torch.tensor([0.0])
    log_rho = torch.log(torch.tensor([[2.0], [0.5], [0.25]]))
    vs, adv = vtrace(rewards, values, dones, next_value, next_done, log_rho, gamma, lam)
    rho = [1.0, 0.5, 0.25]  # min(rho, 1)
    c = [lam * x for x in rho]
    d2 = rho[2] * (0.0 + gamma * 0.4 - 0.3)
    d1 = rho[1] * (1.0 - 0.2)  # the episode ends after step 1: no bootstrap
    d0 = rho[0] * (0.0 + gamma * 0.2 - 0.5)
    v2 = 0.3 + d2
    v1 = 0.2 + d1
    v0 = 0.5 + d0 + gamma * c[0] * (v1 - 0.2)
    assert vs.squeeze(-1).tolist() == pytest.approx([v0, v1, v2], rel=1e-5)
    a = [rho[0] * (0.0 + gamma * v1 - 0.5), rho[1] * (1.0 - 0.2), rho[2] * (gamma * 0.4 - 0.3)]
    assert adv.squeeze(-1).tolist() == pytest.approx(a, rel=1e-5)
    # on-policy (rho = 1) the targets are the GAE(lambda) returns
    vs1, _ = vtrace(rewards, values, dones, next_value, next_done, torch.zeros(3, 1), gamma, lam)
    gae2 = gamma * 0.4 - 0.3
    gae1 = 1.0 - 0.2
    gae0 = gamma * 0.2 - 0.5 + gamma * lam * gae1
    assert (vs1 - values).squeeze(-1).tolist() == pytest.approx([gae0, gae1, gae2], rel=1e-5)
    # the loss: the clipped surrogate around the learner's pi_old
    mb = minibatch()
    old, new, adv_mb = mb["old_logp"].exp().tolist(), mb["logp"].exp().tolist(), mb["advantages"].tolist()
    want = np.mean([ppo_term(n / o, x) for o, n, x in zip(old, new, adv_mb)])
    assert float(VTrace().loss(terms(), mb)["policy"]) == pytest.approx(want, rel=1e-5)


def test_vtrace_rollout_hook_runs_in_ppo() -> None:
    run = ParallelStaleness(**SMALL).build("smoke", 1, VTrace())
    rows = [run.step(i >= 2) for i in range(4)]
    assert all(math.isfinite(r["return"]) and math.isfinite(r["value_loss"]) for r in rows)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"lag": -1}, "lag must be >= 0"),
        ({"onset": 50}, "parallel-staleness: onset must be an integer in 1..49 (inside every quick and full run), "
                        "got 50"),
        ({"onset": 0}, "onset must be an integer in 1..49 (inside every quick and full run), got 0"),
        ({"onset": True}, "onset must be an integer in 1..49 (inside every quick and full run), got True"),
        ({"epochs": 0}, "epochs must be >= 1"),
        ({"num_envs": 2.5}, "num_envs must be an integer"),
        ({"num_envs": 3, "num_steps": 5}, "does not split"),
        ({"learning_rate": -1.0}, "learning_rate must be a number > 0"),
        ({"lags": 3}, "unknown knob lags"),
    ],
)
def test_knob_validation(knobs: dict, message: str) -> None:
    with pytest.raises(StabenchError, match=re.escape(message)):
        ParallelStaleness(**knobs)


def test_unknown_fix_and_onset_knob() -> None:
    with pytest.raises(StabenchError, match="unknown stabilizer"):
        registry.make_stabilizer("no-such-fix")
    with pytest.raises(StabenchError, match="unknown stabilizer"):
        ExperimentSpec(tier="quick", tasks=("parallel-staleness",), methods=("baseline", "no-such-fix")).trials()
    assert ParallelStaleness(onset=20).budget("quick").onset == 20
    task = registry.get_task("parallel-staleness")
    assert task.role("vtrace") == "matched-fix" and task.role("dual-clip") == "other"


def test_same_seed_same_rows() -> None:
    task = ParallelStaleness(**SMALL)
    rows = []
    for global_seed in (123, 456):
        torch.manual_seed(global_seed)
        run = task.build("smoke", 3, TokenTIS())
        rows.append([run.step(i >= 2) for i in range(4)])
    assert all(same_rows(x, y) for x, y in zip(*rows))
    assert rows[0][3]["behaviour_kl"] > 0


def test_staleness_grid() -> None:
    cells = staleness_grid("quick")
    assert len(cells) >= 18
    assert {c["num_envs"] for c in cells} >= {4, 8, 16} and len({c["epochs"] for c in cells}) >= 3
    assert len({c["lag"] for c in cells}) >= 2
    assert len({c["num_envs"] * c["num_steps"] for c in cells}) == 1  # equal batch across env counts
    for cell in cells + staleness_grid("full"):
        ParallelStaleness(**cell)  # every cell is a valid knob setting
    with pytest.raises(StabenchError, match="unknown tier"):
        staleness_grid("huge")


def test_return_anchors_demand_learning_after_onset() -> None:
    """Version 2: the ceiling is the room's exact optimum; a learner that never updates (the initial policy,
    near uniform) fails the ground truth and scores below the floor (the onset policy's return)."""
    task = ParallelStaleness()
    table = room_table(6, 30)
    assert task.return_ceiling == pytest.approx(table.optimal_return())
    run = task.build("smoke", 0, registry.make_stabilizer("no-update"))
    rows = [run.step(True) for _ in range(task.budget("smoke").iterations)]
    returns = {round(r["return"], 12) for r in rows}
    assert len(returns) == 1  # no update: the learner's exact return never moves
    untrained = rows[0]["return"]
    assert untrained < task.ground_truth.threshold and task.normalized_return(untrained) < 0
    assert 0 < task.return_floor < task.ground_truth.threshold < task.return_ceiling
