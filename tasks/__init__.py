"""Failure-mode tasks, one module per failure mode (`stabench.suite.registry` names them).

Importing this package (which `import stabench` does) registers every task's gymnasium environment under the
`stabench/` namespace, lazily: an entry point is a string, so a task module is imported only when
`gym.make` builds its environment.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

# Every environment the tasks define: id -> (entry point, default kwargs).
ENVIRONMENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "stabench/EmptyFlat-5x5-v0": ("stabench.tasks.grids:make_empty_flat", {"size": 5}),
    "stabench/EmptyFlat-8x8-v0": ("stabench.tasks.grids:make_empty_flat", {"size": 8}),
    "stabench/EmptyRandomFlat-6x6-v0": ("stabench.tasks.policy_churn:make_empty_random_flat",
                                        {"size": 6, "max_steps": 40}),
    "stabench/TwoGoals-5x5-v0": ("stabench.tasks.representation_collapse:make_two_goals",
                                 {"size": 5, "max_steps": 10}),
    "stabench/EntropyCollapse-v0": ("stabench.tasks.entropy_collapse:EntropyCollapseEnv", {}),
    "stabench/KLTokens-v0": ("stabench.tasks.kl_estimator_bias:KLTokensEnv", {}),
    "stabench/LengthExplosion-v0": ("stabench.tasks.length_explosion:LengthExplosionEnv", {}),
    "stabench/WalkChain-v0": ("stabench.tasks.missing_critic:WalkChainEnv", {}),
    "stabench/RareToolStates-v0": ("stabench.tasks.rare_tool_states:ToolCallEnv", {}),
    "stabench/RewardHacking-v0": ("stabench.tasks.reward_hacking:RewardHackingEnv", {}),
    "stabench/ValueColdStart-v0": ("stabench.tasks.value_cold_start:ChainEnv", {}),
    "stabench/InferenceMismatch-v0": ("stabench.tasks.inference_mismatch:InferenceMismatchEnv", {}),
    "stabench/DegenerateComparisons-v0": ("stabench.tasks.degenerate_comparisons:DegenerateComparisonsEnv", {}),
    "stabench/MoERouting-v0": ("stabench.tasks.moe_routing:MoERoutingEnv", {}),
    "stabench/HardSampleShortcuts-v0": ("stabench.tasks.hard_sample_shortcuts:HardSampleShortcutsEnv", {}),
    "stabench/CalibrationCollapse-v0": ("stabench.tasks.calibration_collapse:CalibrationCollapseEnv", {}),
    "stabench/PlasticityLoss-v0": ("stabench.tasks.plasticity_loss:PlasticityLossEnv", {}),
    "stabench/RewardModelDrift-v0": ("stabench.tasks.reward_model_drift:RewardModelDriftEnv", {}),
}
# The grid worlds a PPO task trains on (flattened MiniGrid rooms).
WORLDS: tuple[str, ...] = ("stabench/EmptyFlat-5x5-v0", "stabench/EmptyFlat-8x8-v0")


def register_environments() -> None:
    """Register every id of `ENVIRONMENTS` with gymnasium (ids already registered are left as they are)."""
    for env_id, (entry_point, kwargs) in ENVIRONMENTS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point, kwargs=dict(kwargs))


register_environments()
