"""What the task modules say of themselves names only what exists: every backticked name in a task module's
docstring, its class docstrings and its paper paragraph is a registered task, stabilizer or detector (or a
column, knob or identifier of the module); measured numbers live in results/calibration.md, not there."""

import ast
import re
from pathlib import Path

import pytest
from stabench.suite import registry

pytestmark = pytest.mark.smoke

TASKS = Path(registry.__file__).resolve().parents[1] / "tasks"
MODULES = sorted(p for p in TASKS.rglob("*.py") if not p.name.startswith("_"))
HYPHENATED = re.compile(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`")
REGISTERED = {*registry.names("task"), *registry.names("stabilizer"), *registry.names("detector")}


def texts(path: Path) -> list[str]:
    """The module docstring, every class and function docstring, and every `paper = "..."` string."""
    tree = ast.parse(path.read_text())
    found = [ast.get_docstring(tree) or ""]
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            found.append(ast.get_docstring(node) or "")
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "paper" for t in node.targets):
            found.append(ast.literal_eval(node.value))
    return found


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_named_methods_are_registered(path):
    named = {name for text in texts(path) for name in HYPHENATED.findall(text)}
    assert not named - REGISTERED, f"{path.name} names what is not registered: {sorted(named - REGISTERED)}"


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_docstrings_hold_no_result_tables(path):
    module = ast.get_docstring(ast.parse(path.read_text())) or ""
    counts = re.findall(r"\b\d+/10\b", module)  # "9/10 fail" is a calibration result: results/calibration.md
    assert not counts, f"{path.name}'s docstring quotes calibration results {counts}: move them to calibration.md"


def test_the_checks_can_fail():
    assert HYPHENATED.findall("the old `grpo-kl-anchor` guard") == ["grpo-kl-anchor"]
    assert "grpo-kl-anchor" not in REGISTERED and "kl-anchor" in REGISTERED
