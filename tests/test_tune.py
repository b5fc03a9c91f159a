"""`stabench tune`: a method's declared space searched with Ray Tune on tuning seeds, the chosen setting recorded,
scored on other seeds (`M@tuned`) and shown on the leaderboard only beside rows tuned with the same budget."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import leaderboard, registry
from stabench.suite import tune as tuning
from stabench.suite.cli import main

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = '''
import torch
from ray import tune
from stabench.suite.api import Stabilizer


class ToyClip(Stabilizer):
    """Clips the gradient norm at max_norm: the toy's fix with one setting to tune (its default does nothing)."""

    name = "toy-clip"
    max_norm: float = 50.0
    search_space = {"max_norm": tune.loguniform(0.01, 1.0)}

    def after_backward(self, model):
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)


class NoSpace(ToyClip):
    name = "no-space"
    search_space = {}


class NotADomain(ToyClip):
    name = "not-a-domain"
    search_space = {"max_norm": [0.1, 1.0]}


class NotASetting(ToyClip):
    name = "not-a-setting"
    search_space = {"gain": tune.uniform(0.0, 1.0)}
'''


def stabench(*argv, timeout=600):
    return subprocess.run([sys.executable, "-m", "stabench.suite.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "toy_clip.py"
    path.write_text(PLUGIN)
    return str(path)


@pytest.fixture(scope="module")
def tuned(plugin, tmp_path_factory):
    """`stabench tune` with a budget of 2 on the toy, then the chosen setting run on the scoring seeds."""
    root = tmp_path_factory.mktemp("tuned")
    out = root / "tuning"
    proc = stabench("tune", "--method", f"{plugin}:ToyClip", "--tasks", f"{TOY}:ToyTask", "--budget", "2",
                    "--tier", "smoke", "--cpus", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    run = root / "run"
    scored = stabench("run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask", "--methods", "baseline", "--stabilizer",
                      f"{plugin}:ToyClip", "--stabilizer", f"{plugin}:ToyClip@tuned={out}", "--seeds", "2",
                      "--cpus", "1", "--no-tensorboard", "--out", str(run))
    assert scored.returncode == 0, scored.stderr
    return out, proc, run


def test_tune_searches_on_tuning_seeds_disjoint_from_the_scoring_seeds_and_records_the_choice(tuned):
    out, proc, _ = tuned
    record = json.loads((out / "tuning.json").read_text())
    assert record["tuning_seeds"] == [1000, 1001]  # the toy's smoke budget: 2 seeds, from 1000
    used = [json.loads(p.read_text())["job"]["seeds"] for p in (out / "tune").glob("*/params.json")]
    assert len(used) == 2 and all(seeds == record["tuning_seeds"] for seeds in used)  # what the trials really ran
    reserved = set(range(10)) | set(range(100, 110))
    assert not reserved & {s for seeds in used for s in seeds}
    history = record["history"]
    assert [h["status"] for h in history] == ["complete", "complete"]
    assert history[0]["setting"] == "max_norm=50"  # the default is the first configuration
    best = max(history, key=lambda h: h["iqm"])
    assert record["setting"] == {"max_norm": best["config/max_norm"]}
    assert record["setting_ref"] == f"{record['method_ref'].rpartition(':')[0]}:ToyClip@{best['setting']}"
    assert best["iqm"] > history[0]["iqm"]  # clipping undoes the toy's shock; its default never clips
    assert record["default_tuning_iqm"] == history[0]["iqm"] and record["tuning_iqm"] == best["iqm"]
    spent = record["spent"]
    assert spent["configurations"] == 2 and spent["runs"] == sum(h["runs"] for h in history) == 4
    assert spent["cpu_seconds"] > 0 and record["budget"] == 2
    assert len(pd.read_csv(out / "history.csv")) == 2
    assert f"chosen: toy-clip@{best['setting']}" in proc.stdout
    assert "budget: 2 configurations" in proc.stdout


def test_the_tuned_setting_runs_on_the_scoring_seeds_and_its_row_says_how_it_was_tuned(tuned, tmp_path):
    out, _, run = tuned
    record = json.loads((out / "tuning.json").read_text())
    name = f"toy-clip@{registry.setting_text(record['setting'])}"
    table, manifest, _ = leaderboard.load_run(run)
    assert set(table["method"]) == {"baseline", "toy-clip", name}
    assert set(table["seed"]) == {0, 1}
    assert manifest["tuning"][name]["budget"] == 2
    assert manifest["tuning"][name]["tuning_seeds"] == [1000, 1001]
    rows = {r["name"]: r for r in leaderboard.compute_rows(table, manifest, ["toy-clip", "toy-clip@tuned"], [])}
    assert json.loads(rows[name]["setting"]) == record["setting"]
    assert json.loads(rows["toy-clip"]["setting"]) == {"max_norm": 50.0}
    assert json.loads(rows[name]["tuning"])["budget"] == 2 and rows["toy-clip"]["tuning"] == "{}"
    assert rows[name]["seeds"] == "0-1"
    board = tmp_path / "leaderboard.csv"
    leaderboard._write(board, list(rows.values()))
    assert main(["verify", str(run), "--leaderboard", str(board)]) == 0  # the new fields recompute too
    table_rows = leaderboard.tuning_table(leaderboard.read(board))
    assert len(table_rows) == 1
    row = table_rows[0]
    assert (row["method"], row["budget"], row["band"], row["default_band"]) == ("toy-clip", 2, 1, 1)
    assert row["has_default"]  # the default row comes from the same run
    assert row["default_setting"] == "max_norm=50" and row["tuning_seeds"] == "1000-1001"
    assert row["gain"] == pytest.approx(float(rows[name]["aggregate"]) - float(rows["toy-clip"]["aggregate"]))


def _tuned_copy(row: dict, name: str, aggregate: float, budget: int, seeds: str = "0-1") -> dict:
    copy = {**row, "name": name, "aggregate": f"{aggregate:.6f}", "ci_low": f"{aggregate:.6f}",
            "ci_high": f"{aggregate:.6f}", "seeds": seeds,
            "tuning": json.dumps({"budget": budget, "tuning_seeds": [1000, 1001], "spent": {}}) if budget else "{}"}
    copy["row_digest"] = leaderboard.row_digest(copy)
    return copy


def test_tuned_rows_are_ranked_only_against_the_same_budget_and_rows_only_on_the_same_seeds(tuned, tmp_path):
    _, _, run = tuned
    table, manifest, _ = leaderboard.load_run(run)
    base = leaderboard.compute_rows(table, manifest, ["toy-clip"], [])[0]
    rows = [_tuned_copy(base, "a", 0.2, 0), _tuned_copy(base, "b", 0.5, 0),  # the defaults, seeds 0-1
            _tuned_copy(base, "a", 0.9, 0, seeds="0-9"),  # another seed set: never a default of the 0-1 rows
            _tuned_copy(base, "a@x=1", 0.6, 2), _tuned_copy(base, "b@x=2", 0.55, 2),  # budget 2: a overtakes b
            _tuned_copy(base, "a@x=3", 0.1, 8)]  # budget 8: ranked alone
    ranked = {(t["method"], t["budget"]): t for t in leaderboard.tuning_table(rows)}
    # zero-width intervals (no overlap): every row a band of its own, and the band flips under tuning
    assert (ranked[("a", 2)]["band"], ranked[("a", 2)]["default_band"]) == (1, 2)
    assert (ranked[("b", 2)]["band"], ranked[("b", 2)]["default_band"]) == (2, 1)
    assert ranked[("a", 2)]["gain"] == pytest.approx(0.4) and ranked[("a", 8)]["band"] == 1
    path = tmp_path / "LEADERBOARD.md"
    leaderboard.render_markdown(rows, path)
    text = path.read_text()
    ranking = text.split("## Tuned stabilizers")[0]  # the seeds 0-1 defaults pair their tuned rows: shown there only
    assert "### Tier smoke, seeds 0-1" not in ranking and "### Tier smoke, seeds 0-9" in ranking
    assert "tuned with a budget of 2 configurations" in text and "tuned with a budget of 8 configurations" in text


def test_the_committed_leaderboard_keeps_its_digests_when_rewritten(tmp_path):
    rows = leaderboard.read(ROOT / "results" / "leaderboard.csv")
    board = tmp_path / "leaderboard.csv"
    leaderboard._write(board, rows)
    assert board.read_text().splitlines()[0].split(",") == leaderboard.COLUMNS
    again = leaderboard.read(board)
    assert [r["row_digest"] for r in again] == [r["row_digest"] for r in rows]
    assert {leaderboard.row_seeds(r) for r in again if r["track"] == "stabilizer"} == {"0-9"}
    line, row = next((i, r) for i, r in enumerate(again, start=2) if r["name"] == "baseline")
    text = board.read_text().splitlines()
    text[line - 1] = text[line - 1].replace(f",{row['aggregate']},", ",0.2,", 1)  # the baseline's aggregate
    board.write_text("\n".join(text) + "\n")
    with pytest.raises(Exception, match=f"tampered row: line {line}"):
        leaderboard.read(board)


def test_settings_are_declared_once_on_the_stabilizers_and_the_defaults_stay():
    defaults = {"kl-anchor": ("coef", 0.3), "entropy-bonus": ("coef", 0.05), "clip-higher": ("eps_high", 0.28),
                "token-tis": ("max_weight", 2.0), "grad-clip": ("max_norm", 0.5)}
    for name, (key, value) in defaults.items():
        cls = registry.resolve_class("stabilizer", name)
        space = tuning.search_space(cls)  # a valid Ray Tune space
        assert list(space) == [key] and getattr(cls, key) == value
        assert space[key].lower < value < space[key].upper  # the default lies inside what tune searches
        assert registry.method_name(name) == name
    made = registry.make_stabilizer("kl-anchor@coef=0.1234567")
    assert made.coef == 0.123 and registry.resolve_class("stabilizer", "kl-anchor").coef == 0.3
    assert registry.method_name("kl-anchor@coef=0.1234567") == "kl-anchor@coef=0.123"  # the name says what runs
    assert tuning.seed_text([0, 1, 2, 5, 100, 101]) == "0-2,5,100-101"


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tune", "--method", "no-such-fix"], "unknown stabilizer 'no-such-fix'"),
        (["tune", "--method", f"{TOY}:ToyFix"], "toy-fix declares no search space"),
        (["tune", "--method", "{plugin}:NoSpace"], "no-space declares no search space"),
        (["tune", "--method", "{plugin}:NotADomain"], "'max_norm' must be a Ray Tune domain"),
        (["tune", "--method", "{plugin}:NotASetting"], "'gain' is not a setting of the class"),
        (["tune", "--method", "{plugin}:ToyClip", "--budget", "0"], "--budget must be at least 1"),
        (["tune", "--method", "{plugin}:ToyClip", "--seed-start", "5"], "tuning seeds 5-6 overlap the scoring seeds"),
        (["tune", "--method", "{plugin}:ToyClip", "--seed-start", "109"], "overlap the fresh-check seeds 100-109"),
        (["tune", "--method", "kl-anchor@coef=0.1"], "name the method (kl-anchor), not a setting"),
        (["tune", "--method", "{plugin}:ToyClip", "--seeds", "0"], "--seeds must be at least 1"),
        (["run", "--methods", "baseline", "--stabilizer", "{plugin}:ToyClip@tuned={out}"], "no tuning record"),
        (["run", "--methods", "baseline", "--stabilizer", "{plugin}:ToyClip@max_norm=big"], "expected a float"),
        (["run", "--methods", "baseline", "--stabilizer", "{plugin}:ToyClip@gain=1"], "has no setting 'gain'"),
        (["run", "--methods", "baseline", "--stabilizer", "{plugin}:ToyClip@"], "malformed setting"),
    ],
)
def test_bad_tuning_input_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path, plugin, argv, message):
    out = tmp_path / "out"
    argv = [a.replace("{plugin}", plugin).replace("{out}", str(out)) for a in argv]
    argv += ["--tasks", f"{TOY}:ToyTask", "--tier", "smoke", "--out", str(out)]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("stabench: error:") and message in err, err
    assert not out.exists() and stdout == ""


def test_a_row_scored_on_the_seeds_it_was_tuned_on_is_refused(tuned, plugin, tmp_path, capsys):
    out, _, _ = tuned
    run = tmp_path / "run"
    code, _, err = run_cli(capsys, "run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask", "--methods", "baseline",
                           "--stabilizer", f"{plugin}:ToyClip@tuned={out}", "--seed-start", "1000", "--out", str(run))
    assert code == 2 and "was tuned on seeds 1000-1001, which this run scores on" in err
    assert not run.exists()


def test_an_extension_naming_the_tuned_setting_keeps_the_folders_tuning_record(tuned, plugin, tmp_path):
    """`--extend` with the setting spelled out (`M@key=value`, which brings no tuning record of its own) keeps
    the record the folder holds: the leaderboard reads it to say how the setting was chosen."""
    out, _, run = tuned
    record = json.loads((out / "tuning.json").read_text())
    name = f"toy-clip@{registry.setting_text(record['setting'])}"
    grown = tmp_path / "grown"
    shutil.copytree(run, grown)
    before = json.loads((grown / "manifest.json").read_text())["tuning"]
    proc = stabench("run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask,{TOY}:SlowToyTask", "--methods", "baseline",
                    "--stabilizer", f"{plugin}:ToyClip", "--stabilizer", f"{plugin}:ToyClip@{name.partition('@')[2]}",
                    "--seeds", "2", "--cpus", "1", "--no-tensorboard", "--out", str(grown), "--extend")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((grown / "manifest.json").read_text())
    assert len(manifest["spec"]["tasks"]) == 2
    assert manifest["tuning"] == before and manifest["tuning"][name]["tuning_seeds"] == [1000, 1001]
