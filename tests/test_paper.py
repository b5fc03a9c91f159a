"""`stabench paper` builds every figure it can from a small fixed results table, and skips the rest."""

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from stabench.suite import paper, paper_inputs

pytestmark = pytest.mark.smoke

DATA = Path(__file__).parent / "data" / "paper_results"
TEMPLATE = Path(__file__).resolve().parents[1] / "paper" / "paper.template.md"
DRAWN = ["suite_failure-mode-map", "kl-estimator-bias_estimators", "dead-layers_gradient-heatmap",
         "parallel-staleness_grid", "suite_entropy", "suite_stabilizer-leaderboard", "suite_detection-latency",
         "suite_precision-lead"]
SKIPPED = ["return and head certainty", "policy-gradient variance", "reasoning length and accuracy",
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
    # numbered as the text shows them, whatever their files are called
    shown = re.findall(r"!\[Figure (\d+): [^]]*\]\(figures/([^)]+)\.png\)", text)
    assert [int(n) for n, _ in shown] == list(range(1, len(shown) + 1)) and len(shown) >= len(DRAWN)
    assert shown[0][1] == "suite_entropy" and "![" not in re.sub(r"!\[Figure \d+: ", "", text)
    assert "parallel-staleness [" not in text  # grid cells feed only the grid figure, not the tables
    # no matrix here: the run's own methods ranked on the common default task set (kl-estimator-bias and dead-layers;
    # parallel-staleness ran only in grid cells): only the baseline ran on both; the experimental value-cold-start apart
    aggregate = (tmp_path / "tables" / "aggregate.md").read_text()
    assert "No method matrix was read" in text and "['" not in aggregate
    assert "| baseline | 2 (acts on 2) |" in aggregate
    assert "kl-max" not in aggregate and "multiskip-residual" not in aggregate  # each ran on one default task
    assert "critic-warmup" not in aggregate and "value-cold-start" not in aggregate
    assert "| value-cold-start | critic-warmup |" in (tmp_path / "tables" / "experimental_returns.md").read_text()


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
    table = paper_inputs.load_results([ROOT / d for d in paper.DEFAULT_RESULTS if (ROOT / d).exists()])
    return table[table["seed"].isin([0, 1, 100, 101])]


@pytest.mark.parametrize("task, figure", TASK_FIGURES, ids=[f"{t}_{f.name}" for t, f in TASK_FIGURES])
def test_every_task_figure_is_drawn_from_the_committed_results(committed, tmp_path, task, figure):
    (tmp_path / "figures").mkdir()
    rows = committed if figure.grid_cells else committed[committed["cell"].fillna("") == ""]
    name = paper.figure_file(task, figure)
    paths = figure.draw(rows, tmp_path, name)
    assert [p.name for p in paths] == [f"{task}_{figure.name}.pdf", f"{task}_{figure.name}.png"]
    with Image.open(paths[1]) as image:
        image.verify()
        assert image.size[0] > 400 and image.size[1] > 200
    with pytest.raises(paper.Skip):  # without its task's rows a figure says why instead of drawing nothing
        figure.draw(committed[committed["task"] != task], tmp_path, name)


def test_every_default_and_experimental_task_has_a_paragraph_and_the_figures_are_named_by_task_and_slug():
    classes = paper.task_classes()
    assert all(len(cls.paper.split()) >= 20 for cls in classes), [c.id for c in classes if len(c.paper.split()) < 20]
    names = [name for name, _ in paper.figure_list()]
    assert len(names) == len(set(names)) and "suite_method-matrix" in names
    assert "tool-recovery_recovery" in names and "degenerate-comparisons_silent-groups" in names
    assert not any(name[0].isdigit() for name in names)  # no number typed by hand: the text numbers them


def test_a_figure_named_with_a_number_or_underscores_is_refused():
    from stabench.suite.api import Figure, StabenchError

    for bad in ("11_tool_recovery", "Recovery", "tool recovery"):
        with pytest.raises(StabenchError, match="not a slug"):
            paper.figure_file("tool-recovery", Figure(bad, "t", "", lambda table, out, name: []))


def test_figures_are_numbered_in_the_order_the_text_shows_them():
    text = "![b](figures/x_b.png) text ![a](figures/suite_a.png)\n![b again](figures/x_b.png)"
    assert paper.number_figures(text) == ("![Figure 1: b](figures/x_b.png) text ![Figure 2: a](figures/suite_a.png)\n"
                                          "![Figure 1: b again](figures/x_b.png)")


def constructed_runs() -> pd.DataFrame:
    """Outcomes of two default tasks and one experimental one: `fix` acts on task-a and is the baseline's copy on
    task-b (as in the method matrix), `only-a` ran on task-a alone, `exp-fix` on the experimental task alone and
    scores far above everything (as chain does on policy-churn)."""
    base = {"task-a": [0.1, 0.2, 0.3, 0.2], "task-b": [0.5, 0.4, 0.6, 0.5], "exp-x": [0.0, 0.1, 0.0, 0.1]}
    plan = [("baseline", "task-a", 0.0, True), ("baseline", "task-b", 0.0, True), ("baseline", "exp-x", 0.0, True),
            ("fix", "task-a", 0.6, True), ("fix", "task-b", 0.0, False), ("only-a", "task-a", 0.7, True),
            ("exp-fix", "exp-x", 1.2, True)]
    rows = []
    for method, task, shift, acts in plan:
        role = "baseline" if method == "baseline" else "matched-fix" if method == "exp-fix" else "other"
        for seed, value in enumerate(base[task]):
            for variant in ("injected", "control"):
                nr = value + shift if variant == "injected" else 1.0
                rows.append({"task": task, "method": method, "role": role, "acts": acts, "seed": seed,
                             "variant": variant, "failed": variant == "injected" and nr < 0.5, "diverged": False,
                             "normalized_return": nr, "post_onset_return": nr, "drawdown": 0.0})
    return pd.DataFrame(rows)


def test_the_stabilizer_figure_ranks_only_methods_on_the_common_default_set_and_shows_experimental_tasks_apart():
    import numpy as np
    from scipy import stats

    per_run = constructed_runs()
    ranking, apart, note = paper.stabilizer_views(per_run, {"exp-x"})
    assert list(ranking["method"]) == ["fix", "baseline"]  # only-a and exp-fix lack the common set: not ranked
    assert (ranking["n_tasks"] == 2).all() and list(ranking["n_acts"]) == [1, 2]
    base = per_run[(per_run.method == "baseline") & (per_run.variant == "injected") & (per_run.task != "exp-x")]
    assert ranking.set_index("method").loc["baseline", "iqm"] == stats.trim_mean(base.normalized_return, 0.25)
    fails = [False] * 4 + [False, True, False, False]  # task-b's seed 1 (0.4 < 0.5) fails
    assert ranking.set_index("method").loc["fix", "failure_rate"] == np.mean(fails)
    assert set(apart["task"]) == {"exp-x"} and set(apart["method"]) == {"baseline", "exp-fix"}
    assert note.startswith("No method matrix was read")
    # with a matrix, the ranking is the matrix's and every task it lacks is shown apart
    matrix_runs = per_run[per_run.task != "exp-x"]
    ranking, apart, note = paper.stabilizer_views(per_run[per_run.method == "baseline"], {"exp-x"}, matrix_runs)
    assert list(ranking["method"]) == ["fix", "baseline"] and "method matrix" in note
    assert set(apart["task"]) == {"exp-x"}
    shown = paper.ranking_table(ranking)
    assert list(shown.columns) == ["band", "method", "tasks", "IQM [95% CI]", "P(improve) [95% CI]", "failure rate"]
    assert list(shown["band"]) == [str(int(b)) for b in ranking["band"]]  # rank bands (suite.bands), by band
    assert all(isinstance(v, str) and "'" not in v for v in shown.to_numpy().ravel())  # no Python lists in cells
    assert shown.loc[0, "tasks"] == "2 (acts on 1)"


def test_the_stabilizer_figure_is_drawn_from_its_views(tmp_path):
    (tmp_path / "figures").mkdir()
    views = paper.stabilizer_views(constructed_runs(), {"exp-x"})
    paths = paper.fig_leaderboard(None, tmp_path, "suite_stabilizer-leaderboard", views)
    with Image.open(paths[1]) as image:
        image.verify()
        assert image.size[0] > 1000  # two panels: the ranking and the experimental tasks apart
    with pytest.raises(paper.Skip):
        paper.fig_leaderboard(None, tmp_path, "suite_stabilizer-leaderboard", (views[0].iloc[:0], views[1], views[2]))


def test_the_line_plots_band_is_seaborns_bootstrap_interval_drawn_at_once():
    """`figures.mean_ci` (the band every line plot draws) against seaborn's own `("ci", 95)` with seed 0, on samples
    of every size a plot meets, with missing values: the same two numbers, bit for bit."""
    from seaborn._statistics import EstimateAggregator
    from stabench.suite.figures import mean_ci

    rng = np.random.default_rng(5)
    finite = 0
    for trial in range(60):
        n = int(rng.integers(2, 40))
        values = rng.normal(rng.normal(0, 50), rng.choice([1e-3, 1.0, 100.0]), n)
        if trial % 3 == 0:
            values[rng.random(n) < 0.3] = np.nan
        data = pd.DataFrame({"y": values})
        theirs = EstimateAggregator("mean", ("ci", 95), n_boot=1000, seed=0)(data, "y")
        ours = EstimateAggregator("mean", mean_ci)(data, "y")
        assert np.array_equal(theirs.to_numpy(), ours.to_numpy(), equal_nan=True), trial
        finite += bool(theirs["ymin"] < theirs["ymax"])
    assert finite >= 50  # real intervals were compared, not NaN against NaN
