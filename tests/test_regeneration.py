"""The regeneration's record (suite/regeneration.py): one machine and one code across sittings."""

from __future__ import annotations

import json
import subprocess

import pytest
from stabench.suite import regeneration


def _repo(path):
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / "suite").mkdir()
    (path / "suite" / "x.py").write_text("A = 1\n")
    (path / "README.md").write_text("words\n")
    for cmd in (["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one"]):
        subprocess.run(["git", *cmd], cwd=path, check=True)


def _commit(path, name, text):
    (path / name).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=path, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "more"], cwd=path, check=True)


def test_steps_are_recorded_and_skipped(tmp_path, monkeypatch):
    _repo(tmp_path)
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "regeneration.json"
    assert regeneration.main([str(state), "begin"]) == 0
    assert regeneration.main([str(state), "finished", "quick"]) == 1
    assert regeneration.main([str(state), "done", "quick"]) == 0
    assert regeneration.main([str(state), "finished", "quick"]) == 0
    assert regeneration.main([str(state), "finished", "matrix"]) == 1
    _commit(tmp_path, "README.md", "other words\n")  # prose may change between sittings
    assert regeneration.main([str(state), "begin"]) == 0
    assert json.loads(state.read_text())["steps"].keys() == {"quick"}


def test_changed_code_or_machine_refuses(tmp_path, monkeypatch, capsys):
    _repo(tmp_path)
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "regeneration.json"
    assert regeneration.main([str(state), "begin"]) == 0
    _commit(tmp_path, "suite/x.py", "A = 2\n")
    assert regeneration.main([str(state), "begin"]) == 2
    assert "code under" in capsys.readouterr().err
    record = json.loads(state.read_text())
    record["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True,
                                      text=True).stdout.strip()
    record["fingerprint"] = {**record["fingerprint"], "cpu_model": "another CPU"}
    state.write_text(json.dumps(record))
    assert regeneration.main([str(state), "begin"]) == 2
    assert "was begun on" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["s.json"], ["s.json", "done"], ["s.json", "begin", "x"], ["s.json", "x"]])
def test_bad_usage(argv):
    assert regeneration.main(argv) == 2
