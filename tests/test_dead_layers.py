"""dead-layers (version 3): the learning-rate schedule both branches share, and the anchors."""

from __future__ import annotations

import copy

import pytest
import torch
from stabench.suite.api import Stabilizer
from stabench.tasks.dead_layers import (
    LEARNING_RATE,
    POST_LEARNING_RATE,
    DeadLayers,
    learning_rate,
    new_room,
)

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)


def test_schedule_is_constant_before_onset_then_decays_linearly_towards_zero() -> None:
    budget = DeadLayers().budget("quick")
    onset, iterations = budget.onset, budget.iterations
    assert all(learning_rate(i, onset, iterations) == LEARNING_RATE for i in range(onset))
    post = [learning_rate(i, onset, iterations) for i in range(onset, iterations)]
    assert post[0] == POST_LEARNING_RATE
    assert all(a > b > 0 for a, b in zip(post, post[1:]))
    assert post[-1] == pytest.approx(POST_LEARNING_RATE / (iterations - onset))


def test_run_applies_the_schedule_in_both_branches() -> None:
    task = DeadLayers()
    budget = task.budget("smoke")
    torch.manual_seed(0)
    run = task.build("smoke", 0, Stabilizer())
    for _ in range(budget.onset):
        run.step(False)
        assert run.trainer.optimizer.param_groups[0]["lr"] == LEARNING_RATE
    for injected in (False, True):
        branch = copy.deepcopy(run)
        for it in range(budget.onset, budget.iterations):
            branch.step(injected)
            want = learning_rate(it, budget.onset, budget.iterations)
            assert all(g["lr"] == want for g in branch.trainer.optimizer.param_groups)


def test_anchors_lie_between_not_learning_and_the_exact_optimum() -> None:
    task, room = DeadLayers(), new_room()
    uniform, _ = room.evaluate(torch.zeros(len(room.obs), 3))  # what `no-update` (a near-uniform policy) earns
    threshold = task.ground_truth.threshold
    assert task.return_floor < threshold < task.return_ceiling <= room.optimal_return() + 1e-9
    assert uniform < threshold
