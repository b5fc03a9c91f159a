"""The machine fingerprint: every run's manifest holds it (an extension keeps it, per session), `--resume` and
`--extend` refuse a folder made on another machine or before fingerprints, and the leaderboard carries it (a column
that older files read without, LEADERBOARD.md's machine key, `--json`), which `verify` notes, never counts."""

import csv
import hashlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import TOY
from stabench.suite import export, leaderboard
from stabench.suite.fingerprint import MACHINE_FIELDS, describe, machine_fingerprint, machine_id

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]
COMMON = ("run", "--tier", "smoke", "--methods", "baseline", "--seeds", "1", "--cpus", "1", "--no-tensorboard")
SLOW = f"{TOY}:SlowToyTask"  # a second toy task for --extend (about 1 s a smoke trial)
OTHER_CPU = {"cpu_vendor": "GenuineIntel", "cpu_model": "Intel Xeon Other 9000", "cpu_capability": "AVX2"}


def stabench(*argv):
    return subprocess.run([sys.executable, "-m", "stabench.suite.cli", *argv], capture_output=True, text=True,
                          timeout=600)


def cli(capsys, *argv) -> tuple[int, str, str]:
    """The CLI in this process: the refusals and the leaderboard commands start no Ray."""
    from stabench.suite.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def folder_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory) -> Path:
    """One finished toy run (the baseline, one seed): about 20 s, most of it Ray's start."""
    out = tmp_path_factory.mktemp("fingerprint") / "run"
    proc = stabench(*COMMON, "--tasks", f"{TOY}:ToyTask", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_manifest_holds_this_machines_fingerprint_and_each_trial_its_workers(toy_run):
    fingerprint = json.loads((toy_run / "manifest.json").read_text())["fingerprint"]
    assert set(fingerprint) == {*MACHINE_FIELDS, "warm_starts"}
    assert all(fingerprint[f] not in ("", None) for f in MACHINE_FIELDS)
    assert fingerprint == machine_fingerprint()  # the driver's
    trials = pd.read_csv(toy_run / "trials.csv", dtype={"machine": str})
    assert list(trials["machine"]) == [machine_id(fingerprint)] * len(trials) and len(trials) == 1  # the worker's


def _edited(toy_run: Path, dest: Path, edit: str) -> Path:
    shutil.copytree(toy_run, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    if edit == "another CPU":
        manifest["fingerprint"].update(OTHER_CPU)
    else:  # a folder made before fingerprints were recorded
        del manifest["fingerprint"]
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dest


@pytest.mark.parametrize("edit", ["another CPU", "no fingerprint"])
@pytest.mark.parametrize("mode", ["--resume", "--extend"])
def test_resume_and_extend_refuse_a_folder_of_another_machine_in_one_line(toy_run, tmp_path, capsys, edit, mode):
    out = _edited(toy_run, tmp_path / "out", edit)
    before = folder_digest(out)
    tasks = f"{TOY}:ToyTask" + (f",{SLOW}" if mode == "--extend" else "")  # else a valid extension
    code, _, err = cli(capsys, *COMMON, "--tasks", tasks, "--out", str(out), mode)
    assert code == 2 and err.count("\n") == 1 and err.startswith("stabench: error:"), err
    here = describe(machine_fingerprint())
    if edit == "another CPU":
        made = describe({**machine_fingerprint(), **OTHER_CPU})
        assert f"was made on another machine ({made}) than this one ({here}; they differ in cpu_vendor, cpu_model, " \
               "cpu_capability)" in err, err
    else:
        assert "was made before machine fingerprints were recorded" in err and here in err, err
    assert folder_digest(out) == before  # nothing ran, nothing changed


def test_an_extension_keeps_the_fingerprint_and_each_session_carries_its_own(toy_run, tmp_path):
    grown = tmp_path / "grown"
    shutil.copytree(toy_run, grown)
    proc = stabench(*COMMON, "--tasks", f"{TOY}:ToyTask,{SLOW}", "--out", str(grown), "--extend")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((grown / "manifest.json").read_text())
    here = machine_fingerprint()
    assert manifest["fingerprint"] == here
    assert [s["fingerprint"] for s in manifest["sessions"]] == [here, here]
    trials = pd.read_csv(grown / "trials.csv", dtype={"machine": str})
    assert set(trials["machine"]) == {machine_id(here)} and len(trials) == 2


def _rows(toy_run: Path, fingerprint: dict | None = None) -> list[dict]:
    table = pd.read_parquet(toy_run / "metrics.parquet")
    manifest = json.loads((toy_run / "manifest.json").read_text())
    if fingerprint is not None:
        manifest["fingerprint"] = fingerprint
    return leaderboard.compute_rows(table, manifest, ["baseline"], [])


def _other(row: dict, name: str, version: str, fingerprint: dict | None) -> dict:
    """The row as if another method had been submitted from another run, made on `fingerprint` (None: none)."""
    row = {**row, "name": name, "version": version, "results_digest": "0" * 64,
           "fingerprint": json.dumps(fingerprint, sort_keys=True, separators=(",", ":")) if fingerprint else "{}"}
    row["row_digest"] = leaderboard.row_digest(row)
    return row


def test_a_leaderboard_row_carries_its_runs_fingerprint_in_csv_json_and_markdown(toy_run, tmp_path):
    fingerprint = json.loads((toy_run / "manifest.json").read_text())["fingerprint"]
    row, = _rows(toy_run)
    assert json.loads(row["fingerprint"]) == fingerprint
    legacy = _other(row, "old-fix", "1", None)  # a run made before fingerprints: `{}`
    board = tmp_path / "leaderboard.csv"
    leaderboard._write(board, [row, legacy])
    assert board.read_text().splitlines()[0].split(",") == leaderboard.COLUMNS
    read = leaderboard.read(board)
    assert [json.loads(r["fingerprint"]) for r in read] == [fingerprint, {}]
    assert [r["fingerprint"] for r in export.json_rows(read)] == [fingerprint, {}]
    for blank in ("{}", ""):  # the field is in the row's digest: emptied, the row no longer matches it
        edited = list(csv.DictReader(io.StringIO(board.read_text())))
        edited[0]["fingerprint"] = blank
        with board.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=leaderboard.COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(edited)
        with pytest.raises(leaderboard.StabenchError, match="tampered row: line 2"):
            leaderboard.read(board)
    page = tmp_path / "LEADERBOARD.md"
    leaderboard.render_markdown([row, legacy], page)
    text = page.read_text()
    assert f"- M1: {describe(fingerprint)}" in text and "- unknown: made before" in text
    header = next(line for line in text.splitlines() if line.startswith("| band | name"))
    assert header.endswith("| machine | date |")
    lines = text.splitlines()
    table = lines[lines.index(header):lines.index(header) + 4]
    assert {line.count("|") for line in table[:4]} == {header.count("|")}  # header, rule and rows agree
    assert table[2].endswith(f"| M1 | {row['date'][:10]} |") and table[3].endswith(f"| unknown | {row['date'][:10]} |")


def test_a_file_with_the_header_before_fingerprint_still_reads_and_grows(tmp_path):
    # the committed rows made before fingerprints, written under the header they were made with
    committed = [r for r in leaderboard.read(ROOT / "results" / "leaderboard.csv") if r["fingerprint"] == ""]
    previous = tmp_path / "previous.csv"
    with previous.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=leaderboard.PREVIOUS_COLUMNS, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(committed)
    assert next(csv.reader(io.StringIO(previous.read_text()))) == leaderboard.PREVIOUS_COLUMNS
    rows = leaderboard.read(previous)  # every row's digest as the old code wrote it
    assert rows and all(r["fingerprint"] == "" for r in rows)
    board = tmp_path / "leaderboard.csv"
    board.write_bytes(previous.read_bytes())
    new = _other(rows[0], "new-fix", "1", machine_fingerprint())
    leaderboard._write(board, [*rows, new])  # what a submission writes: the new header, old rows' field empty
    again = leaderboard.read(board)
    assert [r["row_digest"] for r in again] == [r["row_digest"] for r in [*rows, new]]
    assert again[-1]["fingerprint"] == new["fingerprint"] and again[0]["fingerprint"] == ""
    oldest = tmp_path / "oldest.csv"  # the first header, before `seeds` and the rest too
    row = {k: v for k, v in _other(rows[0], "older-fix", "1", None).items()
           if k in leaderboard.OLD_COLUMNS}
    row["row_digest"] = leaderboard.row_digest(row)
    with oldest.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=leaderboard.OLD_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerow(row)
    assert leaderboard.read(oldest)[0]["fingerprint"] == ""


def test_verify_notes_a_row_made_on_another_machine_than_the_builtin_rows(toy_run, tmp_path, capsys):
    row, = _rows(toy_run)
    assert row["version"] == "builtin"
    elsewhere = {**machine_fingerprint(), **OTHER_CPU}
    board = tmp_path / "leaderboard.csv"
    leaderboard._write(board, [row, _other(row, "my-fix", "1", elsewhere), _other(row, "twin-fix", "1",
                                                                                  machine_fingerprint())])
    code, out, err = cli(capsys, "verify", str(toy_run), "--leaderboard", str(board))
    assert code == 0 and "0 mismatches" in out, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: stabilizer my-fix (1, smoke) was made on {describe(elsewhere)}, the built-in rows on "
                     f"{describe(machine_fingerprint())}: its numbers may differ from theirs by the machine alone"]
    # built-in rows that name no one machine: said once, whatever the other rows
    leaderboard._write(board, [row, _other(row, "kl-anchor", "builtin", elsewhere), _other(row, "my-fix", "1", None)])
    code, _, err = cli(capsys, "verify", "--leaderboard", str(board))
    assert code == 0 and err.count("note:") == 1 and "the built-in rows were made on 2 machines" in err, err
    leaderboard._write(board, [_other(row, "kl-anchor", "builtin", None), _other(row, "my-fix", "1", elsewhere)])
    code, _, err = cli(capsys, "verify", "--leaderboard", str(board))
    assert code == 0 and err.count("note:") == 1 and "the built-in rows record no machine fingerprint" in err, err
