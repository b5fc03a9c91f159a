"""Rank bands: rows whose 95% intervals overlap, directly or through a chain, share a band and are never ordered;
LEADERBOARD.md, the JSON export and the tuned-versus-default table show them, and the tuned table pairs a tuned row
only with a default from the same run."""

import itertools
import json
import math
import random

import pytest
from stabench.suite import export, leaderboard
from stabench.suite.bands import rank_bands
from test_cli import run_cli

pytestmark = pytest.mark.smoke


def bands_of(*intervals, ranked=None):
    """Bands of rows given as (low, high), the aggregate at the middle."""
    return rank_bands([(lo + hi) / 2 for lo, hi in intervals], [lo for lo, _ in intervals],
                      [hi for _, hi in intervals], ranked)


def test_disjoint_intervals_get_distinct_bands_in_order():
    assert bands_of((0.0, 0.2), (0.4, 0.6), (0.8, 1.0)) == [3, 2, 1]
    assert bands_of((0.8, 1.0), (0.0, 0.2), (0.4, 0.6)) == [1, 3, 2]


def test_a_chain_of_overlaps_shares_one_band_though_its_ends_do_not_overlap():
    assert bands_of((0.0, 0.3), (0.25, 0.55), (0.5, 0.8)) == [1, 1, 1]
    assert bands_of((0.0, 0.3), (0.25, 0.55), (0.5, 0.8), (0.9, 1.0)) == [2, 2, 2, 1]
    # a wide interval below joins every narrow one it overlaps, whatever their order by upper end
    assert bands_of((0.9, 1.0), (0.7, 0.8), (0.5, 0.6), (0.0, 0.95)) == [1, 1, 1, 1]


def test_unranked_rows_get_no_band_and_bridge_nothing():
    assert bands_of((0.0, 0.3), (0.25, 0.55), (0.5, 0.8), ranked=[True, False, True]) == [2, None, 1]
    assert rank_bands([math.nan, 0.5], [math.nan, 0.4], [math.nan, 0.6]) == [None, 1]  # no number: no band
    assert rank_bands([], [], []) == []


def test_ties_and_touching_intervals_share_a_band():
    assert bands_of((0.2, 0.4), (0.2, 0.4)) == [1, 1]
    assert bands_of((0.0, 0.4), (0.4, 0.6)) == [1, 1]  # closed intervals: touching overlaps
    assert rank_bands([1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]) == [1, 1, 2]  # zero width (one seed)
    with pytest.raises(ValueError, match="one value per row"):
        rank_bands([1.0], [0.0, 1.0], [2.0])
    with pytest.raises(ValueError, match="low end"):
        rank_bands([1.0], [2.0], [0.0])


def test_bands_are_the_connected_components_of_the_overlap_graph():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        intervals = [tuple(sorted((round(rng.random(), 1), round(rng.random(), 1)))) for _ in range(n)]
        bands = bands_of(*intervals)
        component = list(range(n))  # union-find over every overlapping pair

        def root(i, component=component):
            while component[i] != i:
                i = component[i]
            return i

        for i, j in itertools.combinations(range(n), 2):
            if intervals[i][0] <= intervals[j][1] and intervals[j][0] <= intervals[i][1]:
                component[root(i)] = root(j)
        for i, j in itertools.combinations(range(n), 2):
            assert (bands[i] == bands[j]) == (root(i) == root(j)), intervals
            if bands[i] < bands[j]:  # a higher band lies wholly above
                assert intervals[i][0] > intervals[j][1], intervals


def row(name, aggregate, low, high, *, track="stabilizer", ranked="yes", seeds="0-9", tuning=None, digest="a" * 64,
        setting=None, date="2026-01-01T00:00:00Z"):
    """A leaderboard row built by hand (every column, the digest true)."""
    r = {k: "" for k in leaderboard.COLUMNS}
    r.update(track=track, name=name, version="builtin", tier="quick", suite_version="0.3.0", libraries="{}",
             git_commit="x", date=date, n_seeds="10", per_task=json.dumps({"t": aggregate}),
             control_per_task="{}", aggregate=f"{aggregate:.6f}", ci_low=f"{low:.6f}", ci_high=f"{high:.6f}",
             ranked=ranked, acts_on='["t"]', poi="nan", poi_ci_low="nan", poi_ci_high="nan", seeds=seeds,
             setting=json.dumps(setting or {}), tuning=json.dumps(tuning) if tuning else "{}", failures="{}",
             results_digest=digest)
    r["row_digest"] = leaderboard.row_digest(r)
    return r


ROWS = [row("mid", 0.5, 0.45, 0.55), row("top", 0.9, 0.85, 0.95), row("near-top", 0.84, 0.7, 0.86),
        row("partial", 0.99, 0.98, 1.0, ranked="no"), row("other-seeds", 0.1, 0.05, 0.15, seeds="0-4"),
        row("d-low", 10.0, 8.0, 12.0, track="detector"), row("d-high", 50.0, 49.0, 51.0, track="detector")]


def test_row_bands_rank_like_with_like():
    found = dict(zip((r["name"] for r in ROWS), leaderboard.row_bands(ROWS)))
    assert found == {"top": 1, "near-top": 1, "mid": 2, "partial": None, "other-seeds": 1, "d-high": 1, "d-low": 2}


def test_leaderboard_md_lists_rows_by_band_with_a_band_column_and_says_a_band_is_unordered(tmp_path):
    path = tmp_path / "LEADERBOARD.md"
    leaderboard.render_markdown(ROWS, path)
    text = path.read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert all(line.startswith("| band | name |") for line in table if "| name |" in line)
    shown = [line.split(" | ")[:2] for line in table if "| name |" not in line]
    assert shown == [["| 1", "top"], ["| 1", "near-top"], ["| 2", "mid"], ["| -", "partial"],  # seeds 0-9
                     ["| 1", "other-seeds"],  # seeds 0-4: a table, and bands, of its own
                     ["| 1", "d-high"], ["| 2", "d-low"]]
    assert text.count(leaderboard.BAND_NOTE) == 3  # under every table
    assert "Rows in one band are not ordered" in leaderboard.BAND_NOTE


def test_the_json_export_carries_each_rows_rank_band(capsys, tmp_path):
    board = tmp_path / "leaderboard.csv"
    leaderboard._write(board, ROWS)
    code, out, err = run_cli(capsys, "leaderboard", "--leaderboard", str(board), "--json")
    assert code == 0 and err == ""
    got = {r["name"]: r["rank_band"] for r in json.loads(out)["rows"]}
    assert got == dict(zip((r["name"] for r in ROWS), leaderboard.row_bands(ROWS)))
    assert got["partial"] is None and "null" in out
    assert [r["rank_band"] for r in export.json_rows(ROWS)] == leaderboard.row_bands(ROWS)


def tuned(name, aggregate, low, high, digest, budget=4):
    return row(name, aggregate, low, high, digest=digest, setting={"x": 1},
               tuning={"budget": budget, "tuning_seeds": [1000, 1001], "spent": {"configurations": budget}})


def test_a_tuned_row_is_paired_only_with_a_default_from_the_same_run(tmp_path):
    same, other = "s" * 64, "o" * 64
    rows = [row("a", 0.30, 0.25, 0.35, digest=same, setting={"x": 2}),  # a's default, in the tuned rows' run
            row("b", 0.60, 0.55, 0.65, digest=other),  # b's default from another folder (another machine)
            row("a", 0.10, 0.05, 0.15, digest=other, date="2027-01-01T00:00:00Z"),  # later, but another run
            tuned("a@x=1", 0.40, 0.36, 0.44, same), tuned("b@x=3", 0.70, 0.62, 0.78, same),
            tuned("c@x=1", 0.41, 0.30, 0.45, same)]
    table = {t["method"]: t for t in leaderboard.tuning_table(rows)}
    a, b = table["a"], table["b"]
    assert a["has_default"] and a["default"] == pytest.approx(0.30) and a["gain"] == pytest.approx(0.10)
    assert a["default_setting"] == "x=2"
    assert not b["has_default"] and math.isnan(b["default"]) and math.isnan(b["gain"])
    assert b["default_band"] is None and a["default_band"] == 1
    # bands of the tuned rows: b alone on top; a and c overlap, so they share band 2, unordered
    assert (b["band"], a["band"], table["c"]["band"]) == (1, 2, 2)
    assert [t["method"] for t in leaderboard.tuning_table(rows)] == ["b", "c", "a"]  # by band, then aggregate
    text = "\n".join(leaderboard.tuning_markdown(rows))
    line_b = next(line for line in text.splitlines() if line.startswith("| 1 (-) | b |"))
    assert "no default in the same run" in line_b and "| x=3 (-) | - |" in line_b
    line_a = next(line for line in text.splitlines() if line.startswith("| 2 (1) | a |"))
    assert "+0.1" in line_a and "0.3 [0.25, 0.35]" in line_a
    assert "| band (default's) |" in text and leaderboard.BAND_NOTE in text


def test_a_tuned_rows_same_run_default_is_shown_beside_it_and_not_ranked_again(tmp_path):
    matrix, tuned_run = "m" * 64, "t" * 64
    rows = [row("a", 0.30, 0.25, 0.35, digest=matrix),  # a's row from the method matrix: ranked
            row("a", 0.20, 0.15, 0.25, digest=tuned_run),  # a's default in the tuned run: pairs a@x=1 only
            row("b", 0.28, 0.24, 0.33, digest=tuned_run),  # no tuned b in that run: ranked
            tuned("a@x=1", 0.40, 0.36, 0.44, tuned_run)]
    assert leaderboard.tuned_pairs(rows) == {1}
    assert leaderboard.row_bands(rows)[1] is None and leaderboard.row_bands(rows)[0] == 1
    (t,) = leaderboard.tuning_table(rows)
    assert t["has_default"] and t["default"] == pytest.approx(0.20)
    path = tmp_path / "LEADERBOARD.md"
    leaderboard.render_markdown(rows, path)
    main = path.read_text().split("## Tuned stabilizers")[0]
    assert [line.split(" | ")[1] for line in main.splitlines() if line.startswith("| 1 ")] == ["a", "b"]


def test_leaderboard_md_names_the_tasks_whose_calibration_is_thin(tmp_path):
    path = tmp_path / "LEADERBOARD.md"
    leaderboard.render_markdown(ROWS, path)
    assert "thin or missed" not in path.read_text()  # no margins file: nothing said
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "margins.csv").write_text(
        "task,seeds,meets_bar,meets_rate_checks,missed,thin,spare: references fail,spare: baseline fails,"
        "spare: control healthy,spare: fix helps\n"
        "t1,0-9,True,True,,baseline fails,2,0,1,1\nt2,0-9,True,True,,,2,2,1,1\n")
    leaderboard.render_markdown(ROWS, path)
    text = path.read_text()
    assert "- t1: seeds 0-9: within one seed of the bar: baseline fails" in text and "- t2" not in text
