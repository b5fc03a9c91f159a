"""The run-time warm-start cache (plugin tasks' warm starts; the built-in ones ship as files, test_warm_starts.py):
a hit gives the trained weights bit for bit, any change of source trains afresh."""

from __future__ import annotations

import pytest
import torch
from stabench.tasks.worlds import tokens
from stabench.tasks.worlds.tokens import warm_start
from torch import nn

pytestmark = pytest.mark.smoke


def trainer(calls: list[int]):
    def train() -> nn.Module:
        calls.append(torch.get_num_threads())
        torch.manual_seed(len(calls))  # a second training would give other weights
        return nn.Linear(3, 2)

    return train


def test_a_hit_returns_the_stored_weights_without_training(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STABENCH_CACHE", str(tmp_path))
    source = tmp_path / "task.py"
    source.write_text("A = 1\n")
    calls: list[int] = []
    first = warm_start("toy", trainer(calls), str(source))
    assert calls == [1]  # trained once, on one thread
    (entry,) = tmp_path.glob("toy-*.safetensors")
    second = warm_start("toy", trainer(calls), str(source))
    assert calls == [1] and first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    source.write_text("A = 2\n")  # the task's code changed: a new key, a new training
    third = warm_start("toy", trainer(calls), str(source))
    assert len(calls) == 2 and len(list(tmp_path.glob("toy-*.safetensors"))) == 2
    assert not torch.equal(first["weight"], third["weight"])
    entry.write_bytes(b"damaged")  # a damaged entry is trained afresh and overwritten
    source.write_text("A = 1\n")
    warm_start("toy", trainer(calls), str(source))
    assert len(calls) == 3 and entry.stat().st_size > len(b"damaged")


def test_off_and_unwritable_caches_still_train(tmp_path, monkeypatch) -> None:
    source = tmp_path / "task.py"
    source.write_text("A = 1\n")
    calls: list[int] = []
    monkeypatch.setenv("STABENCH_CACHE", "off")
    assert tokens.cache_dir() is None
    warm_start("toy", trainer(calls), str(source))
    warm_start("toy", trainer(calls), str(source))
    assert len(calls) == 2 and not list(tmp_path.rglob("*.safetensors"))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("STABENCH_CACHE", str(blocker / "cache"))
    with pytest.warns(UserWarning, match="cannot cache the warm start toy"):
        state = warm_start("toy", trainer(calls), str(source))
    assert len(calls) == 3 and set(state) == {"weight", "bias"}


def test_a_task_warm_start_from_the_cache_equals_a_fresh_one(tmp_path, monkeypatch) -> None:
    from stabench.tasks import kl_estimator_bias as kl

    monkeypatch.setenv("STABENCH_CACHE", str(tmp_path))
    fresh = warm_start("kl-estimator-bias/reference", kl._warm_up_reference, kl.__file__)
    cached = warm_start("kl-estimator-bias/reference", lambda: pytest.fail("trained again"), kl.__file__)
    assert fresh.keys() == cached.keys() and all(torch.equal(fresh[k], cached[k]) for k in fresh)
