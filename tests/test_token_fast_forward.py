"""baselines.tokens: the tiny GPT-2's forward without transformers' per-call machinery equals transformers' own,
logits and gradients bit for bit, and steps aside for anything but the plain model."""

from __future__ import annotations

import copy

import pytest
import torch
from stabench.baselines.tokens import _gpt2_logits, _plain_gpt2, lm_hidden, lm_logits, tiny_policy

pytestmark = pytest.mark.smoke
torch.set_num_threads(1)


def _policy(n_actions: int, max_len: int, **sizes: int) -> torch.nn.Module:
    torch.manual_seed(n_actions)
    model = tiny_policy(n_actions, max_len, **sizes)
    with torch.no_grad():  # away from the init, so that every weight matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize(("n_actions", "max_len", "sizes"), [
    (6, 6, {}), (6, 8, {"n_layer": 2}), (10, 10, {"n_embd": 64, "n_head": 4}),
])
@pytest.mark.parametrize("train", [True, False])
def test_logits_and_gradients_equal_transformers(n_actions: int, max_len: int, sizes: dict, train: bool) -> None:
    model = _policy(n_actions, max_len, **sizes).train(train)
    assert _plain_gpt2(model)
    gen = torch.Generator().manual_seed(0)
    for batch, length in [(1, 1), (7, 1), (64, 3), (216, max_len), (13, max_len - 1)]:
        x = torch.randint(0, n_actions + 1, (batch, length), generator=gen)
        theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
        want, got = theirs(input_ids=x, use_cache=False).logits, _gpt2_logits(ours, x)
        assert torch.equal(want, got)
        weights = torch.randn(want.shape, generator=gen)
        (want * weights).sum().backward()
        (got * weights).sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(theirs.parameters(), ours.parameters()))
        for mode in (torch.no_grad, torch.inference_mode):  # the in-place GELU of evaluations
            with mode():
                assert torch.equal(model(input_ids=x, use_cache=False).logits, lm_logits(model, x))


def test_anything_but_the_plain_model_goes_through_transformers() -> None:
    model = _policy(6, 6)
    handle = model.transformer.h[0].mlp.register_forward_hook(lambda *_: None)
    assert not _plain_gpt2(model)
    handle.remove()
    assert _plain_gpt2(model)

    class Sub(type(model)):
        pass

    sub = Sub(model.config)
    assert not _plain_gpt2(sub)
    dropping = tiny_policy(6, 6)
    dropping.config.resid_pdrop = 0.1
    dropping.transformer.h[0].mlp.dropout.p = 0.1
    assert not _plain_gpt2(dropping.train()) and _plain_gpt2(dropping.eval())  # eval mode never draws
    x = torch.randint(0, 7, (4, 3))
    calls = []
    model.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    lm_logits(model, x)
    assert calls == [1]


@pytest.mark.parametrize("train", [True, False])
def test_last_hidden_state_equals_transformers(train: bool) -> None:
    model = _policy(10, 8, n_embd=64, n_head=4).train(train)
    gen = torch.Generator().manual_seed(1)
    for batch, length in [(1, 1), (64, 5), (33, 8)]:
        x = torch.randint(0, 11, (batch, length), generator=gen)
        for mode in (torch.enable_grad, torch.no_grad):
            with mode():
                want = model.transformer(input_ids=x, use_cache=False).last_hidden_state
                assert torch.equal(want, lm_hidden(model, x))
    calls = []
    model.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    lm_hidden(model, torch.zeros(2, 3, dtype=torch.long))
    assert calls == [1]  # a hooked model goes through transformers
