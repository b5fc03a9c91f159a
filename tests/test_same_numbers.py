"""Speed-ups that must move no number: the plain `nn.Sequential` forward, the weights memo of exact evaluations, and
the log-probability forms of entropy and KL (with the exp that skips the CPU's slow underflow path)."""

from __future__ import annotations

import copy

import pytest
import torch
from stabench.baselines.models import SameWeights, sequential
from stabench.suite.diagnostics import (
    categorical_entropy,
    entropy_of_logp,
    exact_kl,
    kl_of_logp,
    probs_of,
)
from torch import nn

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)


def _mlp(activation: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 16), activation(), nn.Linear(16, 16), activation(), nn.Linear(16, 5))


@pytest.mark.parametrize("activation", [nn.Tanh, nn.ReLU])
def test_sequential_equals_the_module_call_in_values_and_gradients(activation: type[nn.Module]) -> None:
    theirs = _mlp(activation)
    ours = copy.deepcopy(theirs)
    x = torch.randn(33, 9)
    want, got = theirs(x), sequential(ours, x)
    assert torch.equal(want, got)
    weights = torch.randn(want.shape)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for a, b in zip(theirs.parameters(), ours.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_sequential_runs_hooks_and_other_layers_through_the_module_call() -> None:
    model = _mlp(nn.Tanh)
    seen: list[str] = []
    model[1].register_forward_hook(lambda module, args, out: seen.append("tanh"))
    model[0].register_forward_hook(lambda module, args, out: seen.append("linear"))
    sequential(model, torch.randn(2, 9))
    assert seen == ["linear", "tanh"]
    odd = nn.Sequential(nn.Linear(9, 4), nn.Sigmoid())
    assert torch.equal(sequential(odd, torch.ones(1, 9)), odd(torch.ones(1, 9)))


def test_same_weights_recomputes_exactly_when_a_weight_or_the_key_changes() -> None:
    model, memo, calls = _mlp(nn.Tanh), SameWeights(), []

    def evaluate(net: nn.Module) -> float:
        calls.append(1)
        return float(net(torch.ones(1, 9)).sum().detach())

    first = memo(evaluate, model)
    assert memo(evaluate, model) == first and len(calls) == 1  # unchanged weights: the stored value
    assert memo(evaluate, model, key=2.0) == first and len(calls) == 2  # another key: computed again
    with torch.no_grad():
        model[0].weight.data[0, 0] += 1.0  # through .data: no version counter moves
    assert memo(evaluate, model, key=2.0) != first and len(calls) == 3
    with torch.no_grad():
        model[0].bias.data[0] = 0.0
        memo(evaluate, model, key=2.0)
        model[0].bias.data[0] = -0.0  # equal as numbers, not as bits: computed again
    memo(evaluate, model, key=2.0)
    assert len(calls) == 5
    branch = copy.deepcopy((model, memo))  # a branch copied at onset keeps the memo for its own copy
    branch[1](evaluate, branch[0], key=2.0)
    assert len(calls) == 5


def test_entropy_and_kl_from_log_probabilities_equal_the_logit_forms() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        logits = torch.randn(64, 7, 12, generator=gen, dtype=dtype) * 4
        logits[:, :, 3] = -1e9  # masked tokens (a constrained decoder's)
        logits[:, 0, 5] = float("-inf")
        logits[:, 1, 6] = -95.0  # an underflow to a subnormal, not to zero
        other = torch.randn(64, 7, 12, generator=gen, dtype=dtype)
        logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(other, -1)
        assert torch.equal(probs_of(logp), logp.exp())
        assert torch.equal(entropy_of_logp(logp), categorical_entropy(logits))
        exact = dict(rtol=0, atol=0, equal_nan=True)  # the -inf logit's KL term is NaN in both
        torch.testing.assert_close(kl_of_logp(logp, logq), exact_kl(logits, other), **exact)
        ref = -(logp.exp() * logp).masked_fill(logp.exp() == 0, 0.0).sum(-1)
        assert torch.equal(categorical_entropy(logits), ref)


def test_entropy_gradient_is_unchanged_by_the_underflow_floor() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(32, 10, generator=gen) * 3
    base[:, 2] = -1e9
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    weights = torch.randn(32, generator=gen)
    (categorical_entropy(a) * weights).sum().backward()
    logp = torch.log_softmax(b, -1)
    p = logp.exp()
    (-(p * logp).masked_fill(p == 0, 0.0).sum(-1) * weights).sum().backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize(("method", "evaluations"), [("no-update", 1), ("baseline", 4)])
def test_a_reference_run_evaluates_its_unchanged_policy_once(monkeypatch, method: str, evaluations: int) -> None:
    """The exact evaluation of calibration-collapse's rows goes through the run's `SameWeights`: a policy that never
    changes is evaluated once, one that learns at every iteration."""
    from stabench.suite.registry import make_stabilizer
    from stabench.tasks import calibration_collapse as cc

    calls = []
    joint = cc.heldout_joint
    monkeypatch.setattr(cc, "heldout_joint", lambda model: calls.append(1) or joint(model))
    run = cc.CalibrationCollapse().build("smoke", 0, make_stabilizer(method))
    rows = [run.step(False) for _ in range(4)]
    assert len(calls) == evaluations
    if method == "no-update":
        assert len({r["heldout_confidence"] for r in rows}) == 1  # the policy's own; the Brier score reads the world
