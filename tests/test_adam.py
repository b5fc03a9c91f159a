"""baselines.adam: the trainers' Adam step and zero_grad equal torch's own bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from stabench.baselines import adam
from torch import nn


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("kind", ["fused", "foreach", "default"])
def test_step_equals_torch(kind: str) -> None:
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "default": {}}[kind]
    ours, theirs = _net(), _net()
    opt_ours = torch.optim.Adam(ours.parameters(), lr=3e-3, eps=1e-5, **options)
    opt_theirs = torch.optim.Adam(theirs.parameters(), lr=3e-3, eps=1e-5, **options)
    gen = torch.Generator().manual_seed(1)
    for i in range(40):
        x = torch.randn(32, 7, generator=gen)
        for model, opt, step, zero in ((ours, opt_ours, adam.step, adam.zero_grad),
                                       (theirs, opt_theirs, torch.optim.Adam.step, None)):
            if zero is None:
                opt.zero_grad(set_to_none=True)
            else:
                zero(opt)
            model(x).pow(2).mean().backward()
            if i % 7 == 3:  # a parameter without a gradient is skipped, as in torch
                model[2].bias.grad = None
            if i == 20:  # the learning rate changed mid-run (a task's schedule)
                opt.param_groups[0]["lr"] = 1e-2
            step(opt)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b)
            assert (a.grad is None) == (b.grad is None)
    for a, b in zip(opt_ours.state.values(), opt_theirs.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_other_optimizers_and_hooks_use_torch() -> None:
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not adam._plain(sgd)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    assert adam._plain(opt)
    calls = []
    handle = opt.register_step_post_hook(lambda *_: calls.append(1))
    assert not adam._plain(opt)
    model(torch.ones(2, 7)).sum().backward()
    adam.step(opt)
    assert calls == [1]
    handle.remove()
    assert adam._plain(copy.deepcopy(opt))
