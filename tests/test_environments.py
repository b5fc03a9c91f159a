"""Every environment registered under the `stabench/` namespace passes gymnasium's checker."""

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from stabench.suite import registry

pytestmark = pytest.mark.smoke

for _name in registry.names("task"):  # importing a task module registers its environments
    registry.get_task(_name)
ENV_IDS = sorted(i for i in gym.registry if i.startswith("stabench/"))


def test_every_task_family_registers_an_environment():
    assert ENV_IDS, "no environment registered under stabench/"


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_check_env(env_id):
    env = gym.make(env_id)
    try:
        check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()
