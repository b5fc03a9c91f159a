"""An example detector in one file: alarm when the task's diagnostic jumps past 10x its early median.

A detector sees one row of diagnostics at a time and answers "alarm?". `for_task` builds a fresh one
for each run, reading the diagnostic the task pairs with detectors and the tier's onset.

    stabench run --tier quick --detector examples/my_detector.py:JumpDetector
"""

import math
import statistics

from stabench import Detector


class JumpDetector(Detector):
    name = "jump"

    def __init__(self, metric: str, warmup: int, above: bool = True, factor: float = 10.0) -> None:
        self.metric, self.warmup, self.above, self.factor = metric, warmup, above, factor
        self.early: list[float] = []

    @classmethod
    def for_task(cls, task, budget) -> "JumpDetector":
        return cls(task.detector.metric, max(3, budget.onset // 2), task.detector.above)

    def update(self, row) -> bool:
        value = float(row.get(self.metric, math.nan))
        if not math.isfinite(value):
            return False
        if len(self.early) < self.warmup:
            self.early.append(abs(value))
            return False
        base = statistics.median(self.early) or 1e-8
        return abs(value) > self.factor * base if self.above else abs(value) < base / self.factor
