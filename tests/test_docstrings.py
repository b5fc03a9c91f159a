"""What the task modules say of themselves names only what exists: every backticked name in a task module's
docstring, its class docstrings and its paper paragraph is a registered task, stabilizer or detector (or a
column, knob or identifier of the module). Measured numbers live in generated files (results/calibration.md, the
paper's tables), never in the prose of a task, stabilizer or suite module: a paragraph names them by placeholder
(`suite.paragraphs`)."""

import ast
import re
from pathlib import Path

import pytest
from stabench.suite import registry

pytestmark = pytest.mark.smoke

ROOT = Path(registry.__file__).resolve().parents[1]
TASKS = ROOT / "tasks"
MODULES = sorted(p for p in TASKS.rglob("*.py") if not p.name.startswith("_"))
PROSE = MODULES + sorted(p for d in ("baselines", "suite") for p in (ROOT / d).rglob("*.py"))
# A count of results: "3 of 10", "3/10" (integers, not the digits of a decimal), read with what follows it.
COUNT = re.compile(r"(?<![\d.])(\d+) ?(/|of) ?(\d+)(?![\d.])")
RESULT = re.compile(r"\b(seeds?|runs?|trials?|fail\w*|pass\w*)\b", re.IGNORECASE)
COUNTED = re.compile(r"\s+(?:[\w-]+\s+){0,2}?(seeds?|runs?|trials?)\b")  # "3 of 10 fresh seeds"
BARE = re.compile(r"\s*(?:[),;.:]|$|\s(?:on|in|at|and|or|with|for|over|fail\w*)\b)")  # "fails 1 of 10;"
POSITION = re.compile(r"\b(?:iterations?|onset|steps?|epochs?|updates?) $", re.IGNORECASE)  # "iteration 11 of 45"
# In a paper paragraph, a spread over seeds, a percentage or "the control's 0.74" is a result too.
PARAGRAPH_RESULT = re.compile(r"\b\d+\.\d+-\d+\.\d+\b|\b\d+(?:\.\d+)?%|\bthe control's \d+\.\d+")
HYPHENATED = re.compile(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`")
REGISTERED = {*registry.names("task"), *registry.names("stabilizer"), *registry.names("detector")}


def texts(path: Path) -> list[str]:
    """The module docstring, every class and function docstring, and every `paper = "..."` string."""
    return [text for text, _ in prose(path)]


def prose(path: Path) -> list[tuple[str, bool]]:
    """`texts`, each with whether it is a paper paragraph."""
    tree = ast.parse(path.read_text())
    found = [(ast.get_docstring(tree) or "", False)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((ast.get_docstring(node) or "", False))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "paper" for t in node.targets):
            found.append((ast.literal_eval(node.value), True))
    return found


def counts(text: str) -> list[str]:
    """The counts of results in `text`: "k of n" or "k/n" followed by seeds, runs or trials, or standing bare
    ("fails 1 of 10", "(8 of 10)") in a sentence about seeds, runs, trials or failing. Not a count: "7 of 8 groups"
    (another noun follows), "iteration 11 of 45", and a slash whose denominator no seed set has (the suite's are
    5, 10 or 20 seeds): a fraction ("1/8", "0/1", "1/256")."""
    text = " ".join(text.split())
    found = []
    for sentence in re.split(r"(?<=\.)\s", text):
        for m in COUNT.finditer(sentence):
            after, before = sentence[m.end():], sentence[:m.start()]
            if POSITION.search(before) or (m.group(2) == "/" and int(m.group(3)) % 5):
                continue
            if COUNTED.match(after) or (BARE.match(after) and RESULT.search(sentence)):
                found.append(m.group(0))
    return found


def measured(text: str, paragraph: bool) -> list[str]:
    """Every measured number `text` types: its counts, and in a paper paragraph its spreads and percentages."""
    return counts(text) + (PARAGRAPH_RESULT.findall(" ".join(text.split())) if paragraph else [])


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_named_methods_are_registered(path):
    named = {name for text in texts(path) for name in HYPHENATED.findall(text)}
    assert not named - REGISTERED, f"{path.name} names what is not registered: {sorted(named - REGISTERED)}"


@pytest.mark.parametrize("path", PROSE, ids=[str(p.relative_to(ROOT)) for p in PROSE])
def test_prose_types_no_measured_number(path):
    typed = [n for text, paragraph in prose(path) for n in measured(text, paragraph)]
    assert not typed, (f"{path.relative_to(ROOT)} types measured numbers {typed}: a docstring points to "
                       "results/calibration.md, a paper paragraph names them by placeholder (suite.paragraphs)")


@pytest.mark.parametrize("text", [
    "the baseline fails 9/10", "fails 4 of 10 seeds", "failed 3 of 10 fresh seeds", "8 of 10 baseline runs fail",
    "it failed on seeds 0-9 and 7 of 10 on fresh seeds", "the head only (failed 8 of 10), or every moment (8 of 10).",
    "the head fails 3 of 10 seeds; only the trunk, 1 of 10; no reset, 10 of 10. The head",
    "CHAIN fails 1/10 (its own control 3/10)",
    "above its control's on 10 of 10 seeds", "helped 2 of 5 seeds", "passes 3 of 20 trials",
])
def test_every_count_form_is_caught(text):
    assert counts(text), text


@pytest.mark.parametrize("text", [
    "with 7 of 8 groups silent, the policy term is 1/8 of the control's", "onset at iteration 11 of 45 in every run",
    "the difficulty filter drops groups at most 1/8 (the lucky ones) and fails", "alarms as 0/1 in every run",
    "the shares (0.02 / 0.6) were chosen on seeds 100-109", "3 of the 4 tokens are masked", "answers one of 10 values",
    "score = 100 (mean w over positives - 1/2 (mean w over failing runs))",
    "a never-learning run earns (1/4 + 1/16 + 1/256) / 4", "groups whose success rate is at most 1/8: they fail",
])
def test_design_numbers_are_not_counts(text):
    assert not counts(text), text


def test_paragraph_results_are_caught_and_placeholders_are_not():
    assert measured("stays at 0.00-0.09 while the control reaches 0.82-0.90", True) == ["0.00-0.09", "0.82-0.90"]
    assert measured("(30% of its answers, the control's 0.74)", True) == ["30%", "the control's 0.74"]
    assert measured("fails {failed:baseline} seeds, {tail_percent:shortcut_rate:baseline} copy", True) == []
    assert measured("stays at 0.00-0.09", False) == []  # a docstring's design ranges (its counts are still caught)


def test_the_checks_can_fail():
    assert HYPHENATED.findall("the old `grpo-kl-anchor` guard") == ["grpo-kl-anchor"]
    assert "grpo-kl-anchor" not in REGISTERED and "kl-anchor" in REGISTERED
