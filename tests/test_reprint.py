"""`stabench reprint` rewrites the tables below the `stabench score` commands of a Markdown record, and nothing else."""

from pathlib import Path

import pytest
from stabench.suite import cli, reprint

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]
RUN = "results/calibration/policy-churn/seeds-100-109"
STALE = "| task | baseline failed |\n|---|---|\n| policy-churn | 1% |"


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def record(tmp_path: Path) -> Path:
    path = tmp_path / "record.md"
    path.write_text(f"""# Record

Prose with a number 0.42 stays.

```bash
stabench score {RUN} --calibration
```

{STALE}

Text after the tables stays.

### policy-churn, seeds 100-109

`stabench score {RUN} --markdown` (its stabilizer track):

| task | method |
|---|---|
| policy-churn | baseline |

### gone, seeds 0-9

```bash
stabench score /tmp/no-such-run --calibration
```

{STALE}
""")
    return path


def test_the_tables_below_a_command_become_its_output_and_the_rest_stays(tmp_path, capsys):
    path = record(tmp_path)
    assert cli.main(["reprint", str(path), "--check"]) == 1  # two tables would change
    assert STALE in path.read_text()  # --check writes nothing
    assert cli.main(["reprint", str(path)]) == 0
    text = path.read_text()
    verdicts = reprint.score_output(f"stabench score {RUN} --calibration")
    assert f"```\n\n{verdicts}\n\nText after the tables stays." in text
    assert "Prose with a number 0.42 stays." in text
    track = reprint.track_rows(RUN, "policy-churn", {})
    assert f"(its stabilizer track):\n\n{track}\n\n### gone" in text
    assert track.splitlines()[2].startswith("| policy-churn | baseline | baseline |")
    assert all(line.startswith("| policy-churn |") for line in track.splitlines()[2:])
    assert text.endswith(f"/tmp/no-such-run --calibration\n```\n\n{STALE}\n")  # a missing folder: kept as it stands
    out = capsys.readouterr().out
    assert "kept as it stands: stabench score /tmp/no-such-run --calibration: no folder /tmp/no-such-run" in out
    assert cli.main(["reprint", str(path), "--check"]) == 0  # now nothing would change


def test_a_missing_file_is_one_error_line(tmp_path, capsys):
    assert cli.main(["reprint", str(tmp_path / "none.md")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"stabench: error: no file {tmp_path / 'none.md'}"]
