"""The reference stabilizers `no-update` and `frozen-at-onset`: learners that do not learn."""

import math

import pytest
import torch
from conftest import TOY
from stabench.suite import registry
from stabench.suite.api import REFERENCE_METHODS
from stabench.suite.references import FrozenAtOnset, NoUpdate
from stabench.suite.trial import TrialSpec, run_trial

TOY_TASK = f"{TOY}:ToyTask"


def _rows(method: str):
    return run_trial(TrialSpec(TOY_TASK, method, 0, "smoke", detectors=()))


@pytest.mark.smoke
def test_no_update_never_moves_the_policy():
    table = _rows("no-update")
    assert (table["status"] == "ok").all()
    assert (table["w"] == 0.0).all()  # the toy's weight starts at 0 and an update would move it toward 1
    assert set(table["role"]) == {"reference"}


@pytest.mark.smoke
def test_frozen_at_onset_learns_until_onset_then_stops_in_both_branches():
    frozen, base = _rows("frozen-at-onset"), _rows("baseline")
    onset = int(frozen["onset_iteration"].iloc[0])
    healthy = frozen[frozen["iteration"] < onset].sort_values(["variant", "iteration"])
    same = base[base["iteration"] < onset].sort_values(["variant", "iteration"])
    assert healthy["w"].tolist() == same["w"].tolist()  # the healthy phase is the baseline's
    assert healthy["w"].iloc[-1] != 0.0  # and it learned something
    for variant in ("injected", "control"):
        post = frozen[(frozen["variant"] == variant) & (frozen["iteration"] >= onset)]["w"]
        assert post.nunique() == 1 and post.iloc[0] == healthy["w"].iloc[-1]
    moved = base[(base["variant"] == "control") & (base["iteration"] >= onset)]["w"]
    assert moved.nunique() > 1  # the baseline keeps learning where the reference stopped


class ImpostorFreeze(FrozenAtOnset):
    """A plugin cannot get itself switched at the onset by subclassing the reference."""

    name = "impostor-freeze"


@pytest.mark.smoke
def test_only_the_builtin_reference_is_told_the_onset():
    table = run_trial(TrialSpec(TOY_TASK, f"{__file__}:ImpostorFreeze", 0, "smoke", detectors=()))
    onset = int(table["onset_iteration"].iloc[0])
    post = table[(table["variant"] == "control") & (table["iteration"] >= onset)]["w"]
    assert post.nunique() > 1


def test_references_are_registered_under_their_names():
    for name in REFERENCE_METHODS:
        assert name in registry.names("stabilizer")
        assert registry.make_stabilizer(name).name == name


# One default task per trainer: a reference must run on each (a `None` gradient means "no update there").
ONE_TASK_PER_TRAINER = ["parallel-staleness", "kl-estimator-bias", "rare-tool-states", "policy-churn",
                        "value-cold-start"]


@pytest.mark.smoke
@pytest.mark.parametrize("task_id", ONE_TASK_PER_TRAINER)
def test_no_update_leaves_every_trainers_policy_untouched(task_id):
    task = registry.get_task(task_id)
    budget = task.budget("smoke")

    def moved(method: str) -> list[str]:
        """The floating-point parameters the smoke run's iterations changed under `method`."""
        torch.manual_seed(0)
        run = task.build("smoke", 0, registry.make_stabilizer(method))
        net = getattr(run.trainer, "policy", None) or run.trainer.model
        before = {k: v.detach().clone() for k, v in net.state_dict().items()}
        for it in range(budget.iterations):
            run.step(it >= budget.onset)
        after = net.state_dict()
        return [k for k in before if before[k].is_floating_point() and not torch.equal(before[k], after[k])]

    assert moved("no-update") == []
    assert moved("baseline")  # the same iterations do train the baseline: the equality above is no accident


class CountingNoUpdate(NoUpdate):
    """`no-update` that counts its `after_backward` calls (one per backward the trainer ran)."""

    name = "counting-no-update"

    def __init__(self) -> None:
        self.backwards = 0

    def after_backward(self, model):
        self.backwards += 1
        super().after_backward(model)


class EveryBackwardNoUpdate(CountingNoUpdate):
    """The same reference, without telling the trainer it drops every gradient: every backward runs."""

    def drops_all_gradients(self) -> bool:
        return False


def _same_row(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@pytest.mark.smoke
@pytest.mark.parametrize("task_id", ["parallel-staleness", "entropy-collapse", "rare-tool-states", "policy-churn"])
def test_a_reference_skips_only_the_backward_passes_nobody_reads(task_id):
    """Skipping the unread backward passes of a reference moves no number: every row (losses, gradient norms of
    the reported gradients, returns) equals the run that does every backward, and fewer backward passes ran."""
    task = registry.get_task(task_id)
    budget = task.budget("smoke")
    runs = {}
    for cls in (CountingNoUpdate, EveryBackwardNoUpdate):
        torch.manual_seed(0)
        stabilizer = cls()
        run = task.build("smoke", 0, stabilizer)
        rows = [run.step(it >= budget.onset) for it in range(budget.iterations)]
        runs[cls] = (rows, stabilizer.backwards)
    (skipped, n_skipped), (full, n_full) = runs[CountingNoUpdate], runs[EveryBackwardNoUpdate]
    assert all(_same_row(a, b) for a, b in zip(skipped, full, strict=True))
    assert 0 < n_skipped < n_full


def test_drops_all_gradients_is_declared_by_the_references_only():
    assert registry.make_stabilizer("no-update").drops_all_gradients() is True
    frozen = registry.make_stabilizer("frozen-at-onset")
    assert frozen.drops_all_gradients() is False  # trains like the baseline until the harness freezes it
    frozen.inner.frozen = True
    assert frozen.drops_all_gradients() is True
    assert registry.make_stabilizer("grad-clip").drops_all_gradients() is False
