"""Failure-mode tasks, one module per failure mode; what several tasks share lives below them in `worlds`.

A task module registers itself: its `Task` subclass is found by `stabench.suite.registry.discover` (read from the
source, without importing the module), and importing this package (which `import stabench` does) registers the
gymnasium environments the tasks and the worlds declare in their `environments`, lazily: an entry point is a
string, so a module is imported only when `gym.make` builds its environment.
"""

from __future__ import annotations

from stabench.suite import registry

registry.register_environments(registry.builtin_environments())
