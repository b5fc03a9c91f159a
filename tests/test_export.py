"""`stabench leaderboard --json` and `--hf`: every row, its per-task values and its intervals, leave the repository
in machine-readable form; bad input writes nothing."""

import json
import math

import pytest
import yaml
from stabench.suite import leaderboard
from stabench.suite.cli import main
from test_cli import run_cli, toy_run_folder

pytestmark = pytest.mark.smoke


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """A leaderboard with the toy run's stabilizer and detector rows (what `submit` appends)."""
    root = tmp_path_factory.mktemp("board")
    table = toy_run_folder(root / "run")
    rows = leaderboard.compute_rows(table, {"spec": {"tier": "smoke"}, "suite_version": "x", "libraries": {}},
                                    ["baseline", "toy-fix"], ["threshold", "never"])
    path = root / "leaderboard.csv"
    leaderboard._write(path, rows)
    return path


def test_json_holds_every_row_with_its_per_task_values_and_intervals(capsys, board):
    code, out, err = run_cli(capsys, "leaderboard", "--leaderboard", str(board), "--json")
    assert code == 0 and err == ""
    assert "NaN" not in out  # JSON has no NaN: a missing value is null
    data = json.loads(out)
    rows = leaderboard.read(board)
    assert [(r["track"], r["name"]) for r in data["rows"]] == [(r["track"], r["name"]) for r in rows]
    for got, row in zip(data["rows"], rows):
        per = json.loads(row["per_task"])
        assert {t: c["value"] for t, c in got["per_task"].items()} == {
            t: (None if v is None or math.isnan(v) else v) for t, v in per.items()}
        for key, field in (("value", "aggregate"), ("ci_low", "ci_low"), ("ci_high", "ci_high")):
            want = float(row[field])
            assert got["aggregate"][key] == (None if math.isnan(want) else want)
        if row["track"] == "stabilizer":
            assert got["probability_of_improvement"]["ci_low"] == float(row["poi_ci_low"])
            control = json.loads(row["control_per_task"])
            assert {t: c["control"] for t, c in got["per_task"].items()} == control
            assert got["ranked"] == (row["ranked"] == "yes") and got["n_seeds"] == int(row["n_seeds"])
    fix = next(r for r in data["rows"] if r["name"] == "toy-fix")
    assert fix["per_task"]["toy"]["acts"] is True and fix["version"] == "1"


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_hf_export_is_a_model_index_huggingface_hub_reads(capsys, board, tmp_path, suffix):
    out_file = tmp_path / f"eval{suffix}"
    code, out, err = run_cli(capsys, "leaderboard", "--leaderboard", str(board), "--hf", str(out_file))
    assert code == 0 and err == "" and str(out_file) in out
    text = out_file.read_text()
    index = (json.loads(text) if suffix == ".json" else yaml.safe_load(text))["model-index"]
    rows = leaderboard.read(board)
    assert [e["name"] for e in index] == [r["name"] if r["version"] == "builtin" else f"{r['name']}-v{r['version']}"
                                          for r in rows]
    from huggingface_hub.repocard_data import model_index_to_eval_results

    for entry, row in zip(index, rows):
        name, results = model_index_to_eval_results([entry])
        assert name == entry["name"] and results
        assert {r.task_type for r in results} == {"reinforcement-learning"}
        per_task = {r.dataset_config: r.metric_value for r in results
                    if r.metric_type in ("normalized_return", "detector_skill")}
        want = {t: v for t, v in json.loads(row["per_task"]).items() if v is not None and not math.isnan(v)}
        assert per_task == want
        aggregate = [r for r in results if r.metric_type in ("iqm_normalized_return", "mean_detector_skill")]
        if row["aggregate"] != "nan":
            (agg,) = aggregate
            assert agg.metric_value == float(row["aggregate"])
            assert (agg.metric_args["ci_low"], agg.metric_args["ci_high"]) == (float(row["ci_low"]),
                                                                               float(row["ci_high"]))
            assert agg.metric_args["confidence"] == 0.95 and agg.dataset_split == "smoke"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf", "{tmp}/eval.txt"], "--hf writes .yaml, .yml or .json, not 'eval.txt'"),
        (["--hf", "{tmp}/no/such/folder/eval.yaml"], "does not exist"),
        (["--hf", "{tmp}/a-file/eval.yaml"], "a-file is not a folder"),
        (["--hf", "{tmp}/taken.yaml"], "is a folder"),
        (["--hf", "/proc/eval.yaml"], "/proc/eval.yaml"),  # unwritable, for root too
        (["--hf", "{tmp}/eval.yaml", "--json"], "not allowed with argument"),
        (["--json", "--hf", "{tmp}/eval.yaml"], "not allowed with argument"),
    ],
)
def test_bad_export_input_is_one_line_exit_2_and_writes_nothing(capsys, board, tmp_path, argv, message):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "taken.yaml").mkdir()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = run_cli(capsys, "leaderboard", "--leaderboard", str(board), *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("stabench: error:") and message in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert not list(tmp_path.glob(".eval*"))  # no temporary file left either


def test_an_empty_leaderboard_exports_no_rows(capsys, tmp_path):
    assert main(["leaderboard", "--leaderboard", str(tmp_path / "none.csv"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == []
