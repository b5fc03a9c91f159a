"""stabench: controlled experiments for reinforcement-learning training stability.

The public API is small: `Task`, `Stabilizer`, `Detector` (from `suite.api`), the registries in
`suite.registry`, and the `stabench` command (`suite.cli`).
"""

from suite.api import Budget, Detector, DetectorSpec, Diverged, GroundTruth, Stabilizer, Task, TrainState

__version__ = "0.2.0"  # 0.2: tasks demand learning after onset, floors anchored on the frozen policy
__all__ = ["Budget", "Detector", "DetectorSpec", "Diverged", "GroundTruth", "Stabilizer", "Task", "TrainState"]
