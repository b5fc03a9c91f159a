"""A new task touches its own module only: one defined in a package outside the suite, joined through an entry
point, is listed, registers its environment with gymnasium, runs on the smoke tier and is drawn in the paper."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from stabench.suite import paper, registry

pytestmark = pytest.mark.smoke

PLUGINS = Path(__file__).parent / "plugins"

TOY_PACKAGE = '''
"""A one-file task outside the suite: the toy's scale shock, with its environment, figure and paragraph."""

import gymnasium as gym
import numpy as np
from stabench.suite.api import Figure
from stabench.suite.figures import need, side_by_side
from toy import ToyTask


class CoinEnv(gym.Env):
    """Guess a coin that always lands heads: reward 1 for action 1."""

    def __init__(self, bias: float = 1.0) -> None:
        self.bias = bias
        self.observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), float(action == 1) * self.bias, True, False, {}


def draw(table, out, name):
    rows = need(table, "plug-toy", "w")
    return side_by_side(rows, [("w", "the scalar weight"), ("return", "return")], "variant", "plug-toy", out, name)


class PlugToy(ToyTask):
    """A gradient-scale shock makes SGD oscillate (by construction)."""

    id = "plug-toy"
    environments = {"plug/Coin-v0": ("CoinEnv", {"bias": 1.0})}
    figures = (Figure("weight", "plug toy", "the weight and the return of the plug toy", draw),)
    paper = "The plug toy shocks the gradient scale; its weight oscillates after onset."
'''


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    """A package `plugtoy` with an entry point in the group `stabench.tasks`, importable here and by Ray's workers."""
    (tmp_path / "plugtoy.py").write_text(textwrap.dedent(TOY_PACKAGE))
    dist = tmp_path / "plugtoy-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugtoy\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[stabench.tasks]\nplug-toy = plugtoy:PlugToy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(PLUGINS))
    path = os.pathsep.join([str(tmp_path), str(PLUGINS), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    return tmp_path


def test_a_plugin_task_is_listed_registered_run_and_drawn(plugin, tmp_path):
    assert "plug-toy" in registry.names("task")
    task = registry.get_task("plug-toy")  # loading a plugin task registers its environments
    assert task.id == "plug-toy"
    env = gym.make("plug/Coin-v0")
    check_env(env.unwrapped, skip_render_check=True)
    assert env.unwrapped.bias == 1.0

    listing = subprocess.run([sys.executable, "-m", "stabench.suite.cli", "list"], capture_output=True, text=True,
                             timeout=300)
    assert listing.returncode == 0 and "plug-toy" in listing.stdout

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "stabench.suite.cli", "run", "--tier", "smoke", "--tasks",
                           "plug-toy", "--seeds", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import pandas as pd

    table = pd.read_parquet(out / "metrics.parquet")
    assert set(table["task"]) == {"plug-toy"} and (table["status"] == "ok").all()

    book = tmp_path / "book"
    book.mkdir()
    (book / "paper.template.md").write_text("# Tasks\n\n{{text:task_sections}}\n")
    lines: list[str] = []
    paper.build([out], book, log=lines.append, matrix=None)
    assert (book / "figures" / "plug-toy_weight.png").stat().st_size > 1000
    text = (book / "paper.md").read_text()
    assert "### plug-toy" in text and "its weight oscillates after onset" in text
    assert "![Figure 1: the weight and the return of the plug toy](figures/plug-toy_weight.png)" in text


def test_register_task_adds_a_task_and_its_environment_at_run_time(plugin, monkeypatch):
    import plugtoy

    monkeypatch.setattr(registry, "_REGISTERED_TASKS", {})  # this test's registrations end with it

    class Renamed(plugtoy.PlugToy):
        id = "plug-toy-renamed"
        environments = {"plug/CoinHalf-v0": ("plugtoy:CoinEnv", {"bias": 0.5})}

    registry.register_task(Renamed)
    assert "plug-toy-renamed" in registry.names("task")
    assert registry.get_task("plug-toy-renamed").id == "plug-toy-renamed"
    assert gym.make("plug/CoinHalf-v0").unwrapped.bias == 0.5
    with pytest.raises(registry.StabenchError, match="built-in task"):

        class Clash(plugtoy.PlugToy):
            id = "entropy-collapse"

        registry.register_task(Clash)
