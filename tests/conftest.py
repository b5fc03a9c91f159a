"""Test settings: nothing may reach a model hub, render to a screen, or report Ray usage; warm starts are
cached in a folder of this session, not the user's cache."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["STABENCH_CACHE"] = tempfile.mkdtemp(prefix="stabench-test-cache-")
atexit.register(shutil.rmtree, os.environ["STABENCH_CACHE"], True)

TOY = str(Path(__file__).parent / "plugins" / "toy.py")
