"""The empty rooms' numpy vector env equals the SyncVectorEnv of wrapped single rooms it replaces, bit for bit."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from stabench.tasks.worlds.grids import RoomVectorEnv, make_env, make_vector_env

ROOM = "stabench/EmptyFlat-5x5-v0"  # the registered empty room; a size kwarg builds the others


def same_step(a: tuple, b: tuple, k: int) -> int:
    """Assert two vector envs' step results equal (observation, reward, terminated, truncated: values and dtypes;
    the ended episodes' true return and length); return how many episodes ended."""
    for x, y in zip(a[:4], b[:4]):
        assert np.array_equal(x, y) and x.dtype == y.dtype, k
    f1, f2 = a[4].get("final_info", {}), b[4].get("final_info", {})
    assert ("episode" in f1) == ("episode" in f2), k
    if "episode" not in f1:
        return 0
    m = f1["_episode"]
    assert np.array_equal(m, f2["_episode"]), k
    for key in ("r", "l"):  # the true, unscaled return and the length
        assert np.array_equal(f1["episode"][key][m], f2["episode"][key][m]), k
    return int(m.sum())


@pytest.mark.parametrize("size", [5, 8])
def test_room_vector_env_equals_sync_vector_env(size: int) -> None:
    n = 6
    ref = gym.vector.SyncVectorEnv([lambda: make_env(ROOM, size=size) for _ in range(n)],
                                   autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    mine = make_vector_env(ROOM, n, size=size)
    assert isinstance(mine, RoomVectorEnv)
    o1, o2 = ref.reset(seed=3)[0], mine.reset(seed=3)[0]
    assert np.array_equal(o1, o2) and o1.dtype == o2.dtype
    rng, ended = np.random.default_rng(0), 0
    for k in range(2500):
        if k == 600:  # a new room from each env's next reset on, as the SyncVectorEnv's sub-envs do
            for env in (ref, mine):
                env.call("change_room", (2, 2), 20)
        if k == 1200:
            for env in (ref, mine):
                env.set_attr("reward_scale", 1000.0)
        actions = rng.choice(3, size=n, p=[0.2, 0.2, 0.6])
        ended += same_step(ref.step(actions), mine.step(actions), k)
        for name in ("goal", "max_steps", "reward_scale"):
            assert tuple(ref.get_attr(name)) == mine.get_attr(name)
    assert ended > 100 and mine.get_attr("goal") == ((2, 2),) * n


def test_room_vector_env_refuses_what_it_does_not_offer() -> None:
    env = RoomVectorEnv(2)
    env.reset()
    with pytest.raises(ValueError):
        env.step(np.array([0, 3]))
    with pytest.raises(AttributeError):
        env.call("render")
    with pytest.raises(AttributeError):
        env.set_attr("max_steps", 5)
