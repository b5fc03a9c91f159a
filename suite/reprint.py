"""Reprint the measured tables of a Markdown record (`results/calibration.md`) from the commands written above them,
so that after a regeneration the record states what the committed folders hold, and nobody copies a table by hand.

Two forms are read, and nothing else in the file is touched:
- a ```bash fence that holds one `stabench score ...` command and nothing else: the tables right below the fence
  (table lines and the blank lines between them) are replaced by the command's output;
- a section `### TASK, seeds ...` whose first line names `` `stabench score DIR --markdown` ``: the table below it
  is replaced by TASK's rows of DIR's stabilizer track (the table `stabench score DIR --markdown` prints first).

A command whose folders do not exist (a run made in /tmp and not kept) or that fails is left as it stands, with its
tables, and named in the report: an old record stays a record of what it says.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from stabench.suite.api import StabenchError

FENCE = re.compile(r"^```bash\s*$")
SECTION = re.compile(r"^### (?P<task>[a-z0-9-]+), seeds\b")
TRACK = re.compile(r"^`stabench score (?P<dir>\S+) --markdown`")


@dataclass
class Report:
    """What `reprint` did: the commands whose tables it replaced, changed or not, and those it left, with why."""

    reprinted: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)


def score_output(command: str) -> str:
    """What `command` (one `stabench score ...` line) prints, run in this process; a failure or a missing folder is
    a StabenchError with the reason."""
    from stabench.suite import cli

    argv = shlex.split(command)[2:]
    missing = [a for a in argv if not a.startswith("-") and "/" in a and not Path(a).exists()]
    if missing:
        raise StabenchError(f"no folder {', '.join(missing)}")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["score", *argv])
    if code:
        raise StabenchError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {code}")
    return out.getvalue().strip("\n")


def track_rows(folder: str, task: str, cache: dict[str, str]) -> str:
    """`task`'s rows of `folder`'s stabilizer track as `stabench score FOLDER --markdown` prints them."""
    if folder not in cache:
        cache[folder] = score_output(f"stabench score {folder} --markdown")
    lines = cache[folder].splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| task |")), None)
    if start is None:
        raise StabenchError(f"{folder} has no stabilizer track")
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    rows = [line for line in table[2:] if line.startswith(f"| {task} |")]
    if not rows:
        raise StabenchError(f"{folder} holds no rows of {task}")
    return "\n".join(table[:2] + rows)


def _table_end(lines: list[str], start: int) -> int:
    """The end of the block of tables from `start` on: table lines and the blank lines between them; trailing blank
    lines are not part of it."""
    end, i = start, start
    while i < len(lines) and (lines[i].startswith("|") or not lines[i].strip()):
        i += 1
        if lines[i - 1].startswith("|"):
            end = i
    return end


def reprint(text: str, log=lambda line: None) -> tuple[str, Report]:
    """`text` with every recognised table reprinted (see the module docstring), and what was done."""
    lines = text.split("\n")
    out: list[str] = []
    report = Report()
    cache: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        command, new = None, None
        if FENCE.match(line) and i + 2 < len(lines) and lines[i + 2] == "```" and \
                lines[i + 1].startswith("stabench score ") and "&&" not in lines[i + 1]:
            command = lines[i + 1].strip()
            head, i = lines[i:i + 3], i + 3
            log(f"reprint: {command}")
            try:
                new = score_output(command)
            except StabenchError as why:
                report.kept.append((command, str(why)))
        elif (section := SECTION.match(line)) and i + 2 < len(lines) and (track := TRACK.match(lines[i + 2])):
            command = f"stabench score {track['dir']} --markdown ({section['task']})"
            head, i = lines[i:i + 3], i + 3
            log(f"reprint: {command}")
            try:
                new = track_rows(track["dir"], section["task"], cache)
            except StabenchError as why:
                report.kept.append((command, str(why)))
        if command is None:
            out.append(line)
            i += 1
            continue
        out += head
        gap = i
        while gap < len(lines) and not lines[gap].strip():
            gap += 1
        if gap >= len(lines) or not lines[gap].startswith("|"):
            if new is not None:
                report.kept.append((command, "no table below it"))
            continue
        end = _table_end(lines, gap)
        old = "\n".join(lines[gap:end])
        out += lines[i:gap]
        if new is None:
            out += lines[gap:end]
        else:
            out += new.split("\n")
            report.reprinted.append(command)
            if new != old:
                report.changed.append(command)
        i = end
    return "\n".join(out), report


def reprint_file(path: Path, check: bool = False, log=lambda line: None) -> Report:
    """Reprint `path` in place (unless `check`: then only report what would change)."""
    if not path.is_file():
        raise StabenchError(f"no file {path}")
    text = path.read_text()
    new, report = reprint(text, log)
    if not check and new != text:
        path.write_text(new)
    return report
