"""`stabench paper` builds every figure it can from a small fixed results table, and skips the rest."""

from pathlib import Path

import pytest
from PIL import Image
from stabench.suite import paper

pytestmark = pytest.mark.smoke

DATA = Path(__file__).parent / "data" / "paper_results"
TEMPLATE = Path(__file__).resolve().parents[1] / "paper" / "paper.template.md"
DRAWN = ["01_failure_mode_map", "02_kl_estimators", "03_layer_gradient_heatmap", "07_staleness_grid",
         "09_entropy", "11_stabilizer_leaderboard", "12_detection_latency"]
SKIPPED = ["spectrum and effective rank", "policy-gradient variance", "reasoning length and accuracy",
           "policy churn", "tool-state ratio tails"]


def test_paper_builds_figures_tables_and_text_from_a_fixed_table(tmp_path):
    (tmp_path / "paper.template.md").write_text(TEMPLATE.read_text())
    lines: list[str] = []
    paper.build([DATA], tmp_path, log=lines.append)
    for name in DRAWN:
        for ext in ("png", "pdf"):
            path = tmp_path / "figures" / f"{name}.{ext}"
            assert path.is_file() and path.stat().st_size > 1000, path
        with Image.open(tmp_path / "figures" / f"{name}.png") as image:
            image.verify()
            assert image.size[0] > 400 and image.size[1] > 200
        assert (tmp_path / "figures" / f"{name}.pdf").read_bytes().startswith(b"%PDF")
    for title in SKIPPED:  # their tasks are not in the table: a line says so, no empty figure
        assert any(line.startswith("[") and f"{title}: skipped:" in line for line in lines), title
    assert len(list((tmp_path / "figures").glob("*.png"))) == len(DRAWN)
    for table in ("stabilizer_track", "aggregate", "detector_track", "tasks"):
        assert (tmp_path / "tables" / f"{table}.md").read_text().startswith("| ")
        assert (tmp_path / "tables" / f"{table}.csv").stat().st_size > 0
    text = (tmp_path / "paper.md").read_text()
    assert "{{" not in text and "| dead-layers |" in text
    assert "parallel-staleness [" not in text  # grid cells feed only the grid figure, not the tables


def test_a_template_asking_for_a_table_nobody_makes_is_an_error(tmp_path):
    from stabench.suite.api import StabenchError

    (tmp_path / "paper.template.md").write_text("{{table:no_such_table}}\n")
    with pytest.raises(StabenchError, match="asks for table:no_such_table"):
        paper.build([DATA], tmp_path, log=lambda line: None)


ROOT = Path(__file__).resolve().parents[1]
TASK_FIGURES = [(cls.id, figure) for cls in paper.task_classes() for figure in cls.figures]


@pytest.fixture(scope="module")
def committed():
    """The committed default results, seeds 0, 1, 100 and 101 (every task's figure reads them)."""
    table = paper.load_results([ROOT / d for d in paper.DEFAULT_RESULTS])
    return table[table["seed"].isin([0, 1, 100, 101])]


@pytest.mark.parametrize("task, figure", TASK_FIGURES, ids=[f.name for _, f in TASK_FIGURES])
def test_every_task_figure_is_drawn_from_the_committed_results(committed, tmp_path, task, figure):
    (tmp_path / "figures").mkdir()
    rows = committed if figure.grid_cells else committed[committed["cell"].fillna("") == ""]
    paths = figure.draw(rows, tmp_path)
    assert [p.name for p in paths] == [f"{figure.name}.pdf", f"{figure.name}.png"]
    with Image.open(paths[1]) as image:
        image.verify()
        assert image.size[0] > 400 and image.size[1] > 200
    with pytest.raises(paper.Skip):  # without its task's rows a figure says why instead of drawing nothing
        figure.draw(committed[committed["task"] != task], tmp_path)


def test_every_default_and_experimental_task_has_a_paragraph_and_the_figures_are_numbered_apart():
    classes = paper.task_classes()
    assert all(len(cls.paper.split()) >= 20 for cls in classes), [c.id for c in classes if len(c.paper.split()) < 20]
    names = [f.name for f in paper.figure_list()]
    assert names == sorted(set(names)) and "13_method_matrix" in names and "14_degenerate_comparisons" in names
