"""A user's run gets outputs of its own: `stabench report DIR` (their method highlighted, figures that open) and
`stabench paper DIR --out OUT`, which never touches the committed paper/."""

import hashlib
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import paper, report
from test_cli import run_cli

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = str(ROOT / "examples" / "my_stabilizer.py") + ":SpikeSkip"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory):
    """A run folder of the toy task: the baseline, its matched fix and the example plugin, three seeds."""
    from test_harness import toy_trial

    folder = tmp_path_factory.mktemp("run")
    table = pd.concat([toy_trial(m, s) for m in ("baseline", f"{TOY}:ToyFix", PLUGIN) for s in range(3)],
                      ignore_index=True)
    table.to_parquet(folder / "metrics.parquet")
    return folder


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_report_names_the_plugin_and_its_figures_are_pngs(capsys, plugin_run, tmp_path):
    out = tmp_path / "report"
    code, stdout, err = run_cli(capsys, "report", str(plugin_run), "--out", str(out))
    assert code == 0, err
    text = (out / "report.md").read_text()
    assert stdout.strip() == str(out / "report.md")
    # both plugins of the run are highlighted by default: bold, named with their file
    assert f"Highlighted: **spike-skip** (plugin `{PLUGIN}`), **toy-fix** (plugin `{TOY}:ToyFix`)" in text
    assert "| **spike-skip** | plugin |" in text  # bold among the methods against the baseline
    assert re.search(r"\| \*\*spike-skip\*\* \| other \| \*\*-?\d", text)  # and in the toy task's table
    assert "| **toy-fix** | matched-fix |" in text and "| baseline | baseline |" in text
    for heading in ("## Methods against the baseline", "## Per task", "### toy", "## Detectors"):
        assert heading in text
    figures = re.findall(r"\]\((figures/[^)]+\.png)\)", text)
    assert "figures/methods.png" in figures and any("curves_" in f for f in figures)
    from PIL import Image

    for figure in figures:
        data = (out / figure).read_bytes()
        assert data.startswith(PNG)
        with Image.open(out / figure) as image:
            image.verify()
    with Image.open(out / [f for f in figures if "curves_" in f][0]) as image:
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    assert (pixels == (0xD5, 0x5E, 0x00)).all(1).any()  # the plugin's own colour (report.MINE_COLOURS[0]) is drawn
    for name in ("methods", "stabilizer_track", "detector_track"):
        assert (out / "tables" / f"{name}.csv").is_file()


def test_method_picks_what_is_highlighted(capsys, plugin_run, tmp_path):
    code, _, err = run_cli(capsys, "report", str(plugin_run), "--out", str(tmp_path / "r"), "--method", "toy-fix")
    assert code == 0, err
    text = (tmp_path / "r" / "report.md").read_text()
    assert "Highlighted: **toy-fix** (plugin" in text and "| **spike-skip** |" not in text
    assert "| spike-skip | plugin |" in text  # still reported, not highlighted


def test_the_plugin_is_found_by_default():
    table = pd.DataFrame({"method": ["baseline", "grad-clip", "spike-skip", "toy-fix"]})
    assert report.plugin_methods(table) == ["spike-skip", "toy-fix"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{run}", "--method", "no-such"], "method 'no-such' is not in this run"),
        (["{run}", "--out", "{tmp}/a-file"], "is a file, not a folder"),
        (["/no/such/run"], "no metrics.parquet in /no/such/run"),
    ],
)
def test_bad_report_input_is_one_line_exit_2_and_writes_nothing(capsys, plugin_run, tmp_path, argv, message):
    (tmp_path / "a-file").write_text("x")
    before, run_before = tree_digest(tmp_path), tree_digest(plugin_run)
    argv = [a.replace("{run}", str(plugin_run)).replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "report")]
    code, out, err = run_cli(capsys, "report", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("stabench: error:") and message in err, err
    assert tree_digest(tmp_path) == before and tree_digest(plugin_run) == run_before


def test_paper_out_leaves_the_committed_paper_byte_identical_and_renders_text(capsys, plugin_run, tmp_path,
                                                                             monkeypatch):
    monkeypatch.chdir(ROOT)  # where `paper` (the default folder) is the committed one
    before = tree_digest(ROOT / "paper")
    assert before and "paper.template.md" in before
    out = tmp_path / "mine"
    code, _, err = run_cli(capsys, "paper", str(plugin_run), "--out", str(out))
    assert code == 0, err
    assert tree_digest(ROOT / "paper") == before
    assert not (out / "paper.template.md").exists()  # the text came from the suite's template
    text = (out / "paper.md").read_text()
    assert "{{" not in text and "figures/" in text
    assert list((out / "tables").glob("*.md")) and list((out / "figures").glob("*.png"))


def test_paper_of_a_users_run_without_out_is_refused(capsys, plugin_run, monkeypatch):
    monkeypatch.chdir(ROOT)
    before = tree_digest(ROOT / "paper")
    for argv in (["paper", str(plugin_run)], ["paper", "--rerun"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1
        assert "stabench: error: paper: give your run's paper a folder of its own with --out OUT" in err
    assert tree_digest(ROOT / "paper") == before


def test_the_template_falls_back_to_the_suites_and_ships_with_a_wheel(tmp_path):
    assert paper.template_path(tmp_path) == ROOT / "paper" / "paper.template.md"
    (tmp_path / "paper.template.md").write_text("mine")
    assert paper.template_path(tmp_path) == tmp_path / "paper.template.md"  # OUT's own template wins
    import tomllib

    data_files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    assert data_files["share/stabench"] == ["paper/paper.template.md"]
