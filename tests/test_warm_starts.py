"""The built-in warm starts ship as files checked against the sha256 their tasks declare; nothing trains them at run
time, and a changed or missing file is refused before anything runs."""

from __future__ import annotations

import copy
import hashlib
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file
from stabench.suite import cli, fingerprint, registry
from stabench.suite.api import StabenchError
from stabench.suite.trial import TrialSpec, run_trial
from stabench.tasks.worlds import tokens
from torch import nn

pytestmark = pytest.mark.smoke

NINE = {"calibration-collapse", "digits", "inference-mismatch", "kl-estimator-bias/reference",
        "length-explosion", "moe-routing", "rare-tool-states", "reward-hacking/reference", "tool-recovery"}  # fmt: skip


@pytest.fixture(scope="module")
def starts() -> dict[str, tokens.WarmStart]:
    return tokens.builtin_warm_starts()


def damaged_copy(tmp_path, monkeypatch, name: str, how: str) -> None:
    """The shipped folder copied to tmp_path with one file changed by a byte (or removed), and used from now on."""
    folder = tmp_path / "warm_starts"
    shutil.copytree(tokens.shipped_dir(), folder)
    path = folder / tokens.file_name(name)
    if how == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    monkeypatch.setenv("STABENCH_WARM_STARTS", str(folder))


def test_every_builtin_warm_start_is_its_shipped_file_bit_for_bit(starts) -> None:
    assert set(starts) == NINE
    assert {tokens.file_name(n) for n in starts} == {p.name for p in tokens.shipped_dir().glob("*.safetensors")}
    declared = {tokens.file_name(n).removesuffix(".safetensors"): s.sha256 for n, s in starts.items()}
    assert fingerprint.warm_start_hashes() == declared  # the machine fingerprint hashes the same files
    for name, start in starts.items():
        assert start.sha256 == hashlib.sha256(start.file.read_bytes()).hexdigest(), name
        served, shipped = start.state(), load_file(start.file)
        assert served.keys() == shipped.keys(), name
        assert all(served[k].dtype == shipped[k].dtype and torch.equal(served[k], shipped[k]) for k in served), name
    entropy = starts["digits"]
    assert entropy.tasks() == ["degenerate-comparisons", "entropy-collapse", "hard-sample-shortcuts",
                               "plasticity-loss", "reward-model-drift"]  # fmt: skip
    assert starts["kl-estimator-bias/reference"].tasks() == ["kl-estimator-bias"]


def test_a_changed_or_missing_file_is_refused_in_one_line_naming_its_tasks(tmp_path, monkeypatch, starts) -> None:
    damaged_copy(tmp_path, monkeypatch, "kl-estimator-bias/reference", "changed")
    loaded = copy.copy(starts["kl-estimator-bias/reference"])
    loaded._state = {}
    with pytest.raises(StabenchError, match=r"^the warm start kl-estimator-bias/reference \(used by kl-estimator-bias\)"
                                            r": .* has sha256 .*git checkout.*--retrain kl-estimator-bias/reference"):
        loaded.state()  # loading checks the file again
    monkeypatch.delitem(sys.modules, "stabench.tasks.kl_estimator_bias")  # the task module imported afresh, as a
    with pytest.raises(StabenchError, match="kl-estimator-bias/reference") as info:  # driver does when it plans
        registry.get_task("kl-estimator-bias")
    assert "\n" not in str(info.value)

    damaged_copy(tmp_path / "2", monkeypatch, "digits", "missing")
    monkeypatch.delitem(sys.modules, "stabench.tasks.entropy_collapse")
    monkeypatch.delitem(sys.modules, "stabench.tasks.worlds.digits")
    with pytest.raises(StabenchError, match=r"digits \(used by degenerate-comparisons, entropy-collapse, "
                                            r"hard-sample-shortcuts, plasticity-loss, reward-model-drift\): .* is "
                                            r"missing"):
        registry.get_task("entropy-collapse")


def test_the_run_command_refuses_a_changed_file_before_anything_runs(tmp_path, monkeypatch, capsys) -> None:
    damaged_copy(tmp_path, monkeypatch, "kl-estimator-bias/reference", "changed")
    monkeypatch.delitem(sys.modules, "stabench.tasks.kl_estimator_bias", raising=False)
    out = tmp_path / "run"
    assert cli.main(["run", "--tasks", "kl-estimator-bias", "--tier", "smoke", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stabench: error: the warm start kl-estimator-bias/reference")
    assert "used by kl-estimator-bias" in err[0] and not out.exists()


def test_builtin_token_tasks_train_nothing_and_write_no_cache(tmp_path, monkeypatch, starts) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("STABENCH_CACHE", str(cache))

    def never() -> nn.Module:
        raise AssertionError("a built-in warm start was trained at run time")

    monkeypatch.setattr(tokens, "warm_start", lambda *a: never())
    for start in starts.values():  # loaded afresh from the files during the trials
        monkeypatch.setattr(start, "_state", {})
        monkeypatch.setattr(start, "train", never)
    for task in ("entropy-collapse", "length-explosion", "rare-tool-states", "tool-recovery"):
        table = run_trial(TrialSpec(task, "baseline", 0, "smoke"))
        assert set(table.status) == {"ok"}, task
    for name in ("digits", "length-explosion", "rare-tool-states", "tool-recovery"):
        assert starts[name]._state, name  # the trials did load them
    assert not cache.exists() or not any(cache.iterdir())


def test_the_listing_reports_every_file_as_matching(capsys, starts) -> None:
    assert cli.main(["warm-start"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == len(starts)
    for line, (name, start) in zip(lines, starts.items()):
        assert line.split() == [name, tokens.file_name(name), start.sha256, "matches"]


def test_retrain_writes_the_file_even_when_it_is_changed(tmp_path, monkeypatch, capsys, starts) -> None:
    name = "reward-hacking/reference"  # the quickest to train (about a second)
    damaged_copy(tmp_path, monkeypatch, name, "changed")
    assert cli.main(["warm-start", name]) == 1
    assert "CHANGED" in capsys.readouterr().out
    assert cli.main(["warm-start", "--retrain", name]) == 0
    first, second = capsys.readouterr().out.splitlines()
    sha = hashlib.sha256((tmp_path / "warm_starts" / tokens.file_name(name)).read_bytes()).hexdigest()
    assert first == f"{name} {sha}" and second.strip().startswith(f'sha256="{sha}",')  # the same here; another CPU
    assert "reward_hacking.py:" in second  # may print another sha256 to declare
    assert cli.main(["warm-start", "--retrain"]) == 2 and "name the warm starts" in capsys.readouterr().err
    assert cli.main(["warm-start", "no-such-start"]) == 2


def test_a_plugin_warm_start_without_sha256_keeps_the_run_time_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STABENCH_CACHE", str(tmp_path))
    calls = []

    def train() -> nn.Module:
        calls.append(1)
        return nn.Linear(3, 2)

    plugin = tokens.WarmStart("toy-plugin", train, lambda: nn.Linear(3, 2))
    assert isinstance(plugin(), nn.Linear) and calls == [1]
    assert len(list(tmp_path.glob("toy-plugin-*.safetensors"))) == 1 and "toy-plugin" not in tokens.BUILTIN
