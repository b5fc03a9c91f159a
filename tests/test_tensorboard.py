"""Curves for TensorBoard: every scalar read back with TensorBoard's own reader equals the tidy table; a run writes
them (also after --resume); `stabench tensorboard` exports a folder; `--wandb` without `wandb` is one line."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import curves
from stabench.suite.api import StabenchError
from stabench.suite.cli import main
from stabench.suite.trial import TrialSpec, run_trial

pytestmark = pytest.mark.smoke

# the table's numeric columns that name a run rather than follow it (written nowhere as a curve)
IDENTITY = {"seed", "iteration", "onset_iteration", "iterations", "diverged_at", "acts"}


def toy_table(tier: str = "quick") -> pd.DataFrame:
    """Toy trials: at the quick tier the baseline's injected branch diverges (seed 0 at iteration 28), its fix
    and the control do not."""
    return pd.concat([run_trial(TrialSpec(f"{TOY}:ToyTask", m, s, tier))
                      for m in ("baseline", f"{TOY}:ToyFix") for s in (0, 1)], ignore_index=True)


def read_back(folder: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Every TensorBoard run under `folder`, read with TensorBoard's EventAccumulator (nothing sampled away)."""
    from tensorboard.backend.event_processing.event_accumulator import (
        STORE_EVERYTHING_SIZE_GUIDANCE,
        EventAccumulator,
    )

    runs = {}
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        run = events.parent.relative_to(folder).as_posix()
        assert run not in runs, f"two event files in {run}: an earlier export was not replaced"
        acc = EventAccumulator(str(events.parent), size_guidance=STORE_EVERYTHING_SIZE_GUIDANCE)
        acc.Reload()
        runs[run] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return runs


def expected(table: pd.DataFrame) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """What the table says each run's curves are: per numeric column, its non-empty values by iteration."""
    columns = [c for c in table.select_dtypes(include=["number", "bool"]).columns if c not in IDENTITY]
    runs = {}
    for (task, method, seed, variant), rows in table.groupby(["task", "method", "seed", "variant"]):
        rows = rows.sort_values("iteration")
        runs[f"{task}/{method}/seed-{seed}/{variant}"] = {
            c: [(int(i), float(np.float32(v))) for i, v in zip(rows["iteration"], rows[c].astype(float))
                if not np.isnan(v)]
            for c in columns if rows[c].notna().any()}
    return runs


def assert_exact(folder: Path, table: pd.DataFrame) -> dict:
    got, want = read_back(folder), expected(table)
    assert sorted(got) == sorted(want)
    for run, tags in want.items():
        assert sorted(got[run]) == sorted(tags), run
        for tag, points in tags.items():
            steps, values = zip(*got[run][tag])
            assert list(steps) == [s for s, _ in points], (run, tag)
            assert np.array_equal(np.float32(values), np.float32([v for _, v in points])), (run, tag)  # float32
    return got


def test_every_scalar_of_every_trial_and_variant_equals_the_tidy_table(tmp_path):
    table = toy_table()
    assert curves.export(table, tmp_path / "tb") == 8  # 2 methods x 2 seeds x 2 variants
    got = assert_exact(tmp_path / "tb", table)
    assert (tmp_path / "tb" / curves.MARKER).is_file()
    tags = set(got["toy/baseline/seed-0/control"])
    assert {"return", "step", "w", "grad_norm_total", "grad_norm/00", "alarm/cusum", "alarm/always"} <= tags
    assert not tags & IDENTITY and "entropy" not in tags  # the toy's entropy is empty: no curve
    assert set(got["toy/baseline/seed-0/injected"]["alarm/always"]) == {
        (i, 1.0) for i in range(29)}  # alarms are 0/1 curves
    # the diverged branch keeps its rows up to the divergence; the control runs to the end
    diverged = table[(table.method == "baseline") & (table.seed == 0) & (table.variant == "injected")]
    assert diverged["status"].iloc[0] == "diverged" and diverged["diverged_at"].iloc[0] == 28
    assert [s for s, _ in got["toy/baseline/seed-0/injected"]["return"]] == list(range(28))
    assert [s for s, _ in got["toy/baseline/seed-0/control"]["return"]] == list(range(30))
    # the shared healthy rows appear in both variants, as in the table
    onset = int(table["onset_iteration"].iloc[0])
    assert got["toy/toy-fix/seed-1/injected"]["w"][:onset] == got["toy/toy-fix/seed-1/control"]["w"][:onset]
    assert got["toy/toy-fix/seed-1/injected"]["w"][onset:] != got["toy/toy-fix/seed-1/control"]["w"][onset:]


def test_a_grid_cell_is_a_folder_of_its_own_and_names_stay_inside_the_export(tmp_path):
    table = toy_table("smoke")
    odd = table.assign(cell="lag=2", method=table["method"].replace({"baseline": "a/../b"}))
    table = pd.concat([table.assign(cell="lag=1"), odd], ignore_index=True)
    curves.export(table, tmp_path / "tb")
    runs = sorted(read_back(tmp_path / "tb"))
    assert "toy/lag=1/baseline/seed-0/injected" in runs and "toy/lag=2/a_.._b/seed-1/control" in runs
    assert len(runs) == 16 and all(p.is_relative_to(tmp_path / "tb") for p in tmp_path.rglob("*"))


def test_a_table_that_holds_an_iteration_of_a_run_twice_is_refused(tmp_path):
    table = toy_table("smoke")
    with pytest.raises(StabenchError, match="holds iteration 0 of toy/toy-fix/seed-0/control twice"):
        curves.export(table.assign(method="toy-fix"), tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def test_an_export_replaces_its_own_folder_whole_and_refuses_anyone_elses(tmp_path):
    table = toy_table("smoke")
    curves.export(table, tmp_path / "tb")
    curves.export(table[table.method == "baseline"], tmp_path / "tb")  # the earlier runs are gone, none doubled
    assert_exact(tmp_path / "tb", table[table.method == "baseline"])
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(StabenchError, match="holds files this export did not write"):
        curves.export(table, theirs)
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "tb", "theirs"]  # and no half-written folder beside it


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_tensorboard_command_exports_a_finished_folder(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    table = toy_table("smoke")
    table.to_parquet(run / "metrics.parquet")
    code, out, err = run_cli(capsys, "tensorboard", str(run))
    assert code == 0 and out.strip() == f"tensorboard --logdir {run / 'tensorboard'}" and "8 TensorBoard runs" in err
    assert_exact(run / "tensorboard", table)
    code, out, _ = run_cli(capsys, "tensorboard", str(run), "--out", str(tmp_path / "elsewhere" / "tb"))
    assert code == 0 and out.strip().endswith(str(tmp_path / "elsewhere" / "tb"))
    assert_exact(tmp_path / "elsewhere" / "tb", table)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tensorboard", "/no/such/dir"], "no metrics.parquet in /no/such/dir"),
        (["tensorboard", "{run}", "--out", "{file}"], "is a file, not a folder"),
        (["tensorboard", "{run}", "--out", "{theirs}"], "holds files this export did not write"),
        (["tensorboard"], "the following arguments are required: dir"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--wandb", ""], "--wandb needs a W&B project name"),
        (["run", "--tasks", f"{TOY}:ToyTask", "--wandb", "team/project"], "--wandb needs a W&B project name"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path, argv, message):
    run, file, theirs = tmp_path / "run", tmp_path / "file", tmp_path / "theirs"
    run.mkdir()
    toy_table("smoke").to_parquet(run / "metrics.parquet")
    file.write_text("a file")
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    argv = [a.format(run=run, file=file, theirs=theirs) for a in argv]
    if argv[0] == "run":
        argv += ["--tier", "smoke", "--out", str(tmp_path / "out")]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("stabench: error:") and message in err, err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before
    assert file.read_text() == "a file" and (theirs / "notes.txt").read_text() == "mine"


def test_wandb_when_it_is_not_installed_is_one_line_and_neither_it_nor_rays_callback_is_imported(tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import importlib.util, sys
        if importlib.util.find_spec("wandb") is not None:
            sys.modules["wandb"] = None  # this test is about a machine without it
        from stabench.suite.cli import main
        code = main(["run", "--tier", "smoke", "--tasks", "{TOY}:ToyTask", "--wandb", "my-project",
                     "--out", {str(out)!r}])
        print(code, sorted(m for m, v in sys.modules.items() if "wandb" in m and v is not None))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "2 []", (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("stabench: error: --wandb needs the `wandb` package")
    assert not out.exists()


def stabench(*argv):
    return subprocess.run([sys.executable, "-m", "stabench.suite.cli", *argv], capture_output=True, text=True,
                          timeout=900)


def test_a_run_writes_its_curves_when_it_finishes_and_again_after_resume(tmp_path):
    out = tmp_path / "run"
    argv = ["run", "--tier", "smoke", "--tasks", f"{TOY}:ToyTask", "--methods", f"baseline,{TOY}:ToyFix",
            "--cpus", "1", "--out", str(out)]
    proc = stabench(*argv, "--no-tensorboard")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "tensorboard").exists()  # opted out
    proc = stabench(*argv, "--resume")  # reruns nothing, writes the table and now the curves
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 TensorBoard runs" in proc.stderr and f"tensorboard --logdir {out / 'tensorboard'}" in proc.stderr
    table = pd.read_parquet(out / "metrics.parquet")
    assert_exact(out / "tensorboard", table)
    assert set(table["variant"]) == {"injected", "control"} and set(table["method"]) == {"baseline", "toy-fix"}
